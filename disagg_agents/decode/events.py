"""The events-out stage: a finished request's last text, its metrics and
timeline, and DONE (the TOKEN frames before it: decode.tokenframes)."""

from __future__ import annotations

import logging
import time

from disagg_agents.decode.job import Job
from disagg_agents.decode.placement import Placement
from disagg_agents.decode.tokenframes import send_events
from disagg_agents.wire.answer import Done, ToolCall
from disagg_agents.wire.channel import send_json
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.timeline import Timeline

log = logging.getLogger("disagg.decode")


def finish(placement: Placement, job: Job) -> None:
    """The answer's last text, the request's metrics and timeline, then DONE."""
    chat, out, metrics = job.parser, job.out, job.metrics
    assert chat is not None  # opened by firsttoken
    send_events(job.sock, None, chat.finish(cut=len(out) >= job.max_tokens))  # cut: no open call
    job.t_end = time.perf_counter()
    decoded(placement, job)
    local_span = None if job.marks else (job.t_local, job.t_prefilled)
    seq = job.seq
    joined = seq.joined_at if seq else None
    metrics.timeline = timeline(job, local_span, joined)
    batch_wait = seq.joined_at - seq.posted_at if seq and seq.joined_at else 0.0
    metrics.queue_time = (metrics.prefill_queue_time or 0.0) + batch_wait
    if seq is not None and seq.drafter is not None:
        metrics.draft_tokens = seq.drafter.drafted
        metrics.draft_accepted_tokens = seq.drafter.accepted
    done(job)


def decoded(placement: Placement, job: Job) -> None:
    """A finished request's decode metrics; placement learns its step time
    (and a local prefill's rate)."""
    metrics, n_prompt, n_out = job.metrics, len(job.input_ids), len(job.out)
    decode_s = job.t_end - job.t_first
    prefill_s = metrics.prefill_time
    if metrics.method != "disaggregated" and prefill_s:
        placement.observe_local(n_prompt - (metrics.cached_tokens or 0), prefill_s)
    if n_out > 1:
        placement.observe_step(decode_s / (n_out - 1))
    metrics.completion_tokens = n_out
    # max_tokens here is the request's, capped by what the context leaves.
    called = job.parser is not None and bool(job.parser.tool_calls)
    metrics.finish_reason = (
        "tool_calls" if called else "length" if n_out >= job.max_tokens else "stop"
    )
    metrics.ttft = job.t_first - job.t0
    metrics.decode_time = decode_s
    metrics.decode_speed = (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None
    metrics.tpot = decode_s / (n_out - 1) if n_out > 1 else None
    metrics.agent_total_time = job.t_end - job.t0
    metrics.prefill_speed = (n_prompt / prefill_s) if prefill_s else None


def done(job: Job) -> None:
    """The DONE frame: the answer's text only, reasoning and tool calls beside it."""
    chat, out, metrics = job.parser, job.out, job.metrics
    assert chat is not None  # opened by firsttoken
    frame = Done(
        "".join(chat.content),
        out,
        metrics,
        "".join(chat.reasoning),
        [ToolCall(c.name, c.arguments, c.text) for c in chat.tool_calls],
        job.prompt_ids if job.req.return_prompt_ids else None,
    )
    if job.progress is not None:
        job.progress.stop()  # nothing follows DONE
    send_json(job.sock, Frame.DONE, frame.to_json())
    log.info(
        "%s: %d prompt + %d new tokens, ttft %.3fs, %.1f tok/s, %s",
        metrics.method,
        metrics.prompt_tokens,
        len(out),
        metrics.ttft,
        metrics.decode_speed or 0.0,
        metrics.prefill_address or "local prefill",
    )


def timeline(job: Job, local_span: tuple[float, float] | None, t_joined: float | None) -> Timeline:
    """A result's timeline (disagg_agents.wire.timeline), on this agent's clock:
    prefill_start/prefill_end (remote: the PREFILL frame's send time plus the prefill
    agent's own queue and compute durations), kv_first/kv_last (K/V layers arriving,
    named even when none did), first_token, joined (named even when it never did), done."""
    t0, marks, metrics = job.t0, job.marks, job.metrics

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 6)

    sent = marks.get("sent") if marks is not None else None
    remote = marks is not None and sent is not None
    prefill: tuple[float | None, float | None] = (None, None)
    kv: tuple[float | None, float | None] = (None, None)
    if marks is not None and sent is not None:
        start = sent + float(metrics.prefill_queue_time or 0.0)
        prefill = rel(start), rel(start + float(metrics.prefill_time or 0.0))
        kv = rel(marks.get("kv_first")), rel(marks.get("kv_last"))
    elif local_span is not None:
        prefill = rel(local_span[0]), rel(local_span[1])
    return Timeline(
        job.at,
        *prefill,
        *kv,
        first_token=rel(job.t_first),
        joined=rel(t_joined),
        done=rel(job.t_end),
        nulls=frozenset(("joined", *(("kv_first", "kv_last") if remote else ()))),
    )

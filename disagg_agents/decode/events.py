"""The events-out stage: what a request sends. TOKEN frames as tokens complete
text or a tool call (the first with the prompt's side of the metrics), sent in
bursts; then the finished request's metrics and timeline, and DONE."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from disagg_agents.chatformat import Piece, ToolCall
from disagg_agents.decode.job import Job
from disagg_agents.wire.answer import CONTENT, REASONING, Done, Metrics, TokenEvent
from disagg_agents.wire.answer import ToolCall as WireCall
from disagg_agents.wire.channel import send_json
from disagg_agents.wire.frames import Frame

if TYPE_CHECKING:
    from disagg_agents.decode.agent import DecodeAgent

log = logging.getLogger("disagg.decode")

# What is known once the first token is out: a client that stops reading early (a stop
# string matched, its caller left) still reports the prompt's side of the request.
FIRST_METRICS = (
    "prompt_tokens",
    "cached_tokens",
    "prefill_cached_tokens",
    "disk_cached_tokens",
    "method",
    "prefill_server",
    "decode_server",
    "prefill_time",
    "prefill_queue_time",
    "kv_bytes",
    "kv_transfer_time",
    "weights",
    "placement",
    "placement_reason",
    "fallback_reason",
    "fallback_kind",
)


def first_metrics(metrics: Metrics, at: float, t0: float, t_first: float) -> Metrics:
    """The first TOKEN frame's `metrics`: the prompt's side, the agent's ttft, and the
    timeline so far (`at`, first_token in seconds after it)."""
    early = Metrics.from_json(
        {k: v for k in FIRST_METRICS if (v := getattr(metrics, k)) is not None}
    )
    early.ttft = t_first - t0
    early.timeline = {"at": at, "first_token": t_first - t0}
    return early


def token_events(
    tid: int | None, events: list[Piece | ToolCall], metrics: Metrics | None = None
) -> list[TokenEvent]:
    """What one token completed, as TOKEN frames: the first carries the id (one per
    token, even when markup shows nothing) and on the request's first token its
    `metrics` (first_metrics); text on one channel rides in one frame; a finished
    tool call rides alone."""
    out: list[TokenEvent] = []
    for e in events:
        if isinstance(e, Piece):
            channel = REASONING if e.channel == REASONING else CONTENT
            last = out[-1] if out else None
            if last is not None and last.channel == channel and last.tool_call is None:
                out[-1] = dataclasses.replace(last, text=last.text + e.text)
            else:
                out.append(TokenEvent(text=e.text, channel=channel))
        else:
            out.append(TokenEvent(tool_call=WireCall(e.name, e.arguments, e.text)))
    if tid is not None:
        out[:1] = [dataclasses.replace(out[0] if out else TokenEvent(), id=tid)]
    if metrics is not None and out:
        out[0] = dataclasses.replace(out[0], metrics=metrics)
    return out


def send_events(
    sock: socket.socket,
    tid: int | None,
    events: list[Piece | ToolCall],
    metrics: Metrics | None = None,
) -> None:
    """The TOKEN frames for what one token completed (token_events)."""
    for event in token_events(tid, events, metrics):
        send_json(sock, Frame.TOKEN, event.to_json())


Item = tuple[int, "np.ndarray | None"]


def bursts(out: queue.Queue[Item | Exception | None]) -> Iterator[list[Item]]:
    """A request's tokens as the loop queued them, in bursts: whatever queued up
    while the last burst was being sent (a lagging client) goes out together."""
    while True:
        got = out.get()
        burst: list[Item] = []
        while True:
            if got is None:
                if burst:
                    yield burst
                return
            if isinstance(got, Exception):
                if burst:
                    yield burst
                raise got
            burst.append(got)
            try:
                got = out.get_nowait()
            except queue.Empty:
                break
        yield burst


@contextlib.contextmanager
def corked(sock: socket.socket, on: bool) -> Iterator[None]:
    """A burst's frames in as few TCP segments as fit (Linux TCP_CORK): one
    wake-up for a lagging client instead of one per token."""
    cork = getattr(socket, "TCP_CORK", None)
    if not on or cork is None:
        yield
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, cork, 1)
    except OSError:  # not TCP: nothing to coalesce
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, cork, 0)


def finish(agent: DecodeAgent, job: Job) -> None:
    """The answer's last text, the request's metrics and timeline, then DONE."""
    chat, out, metrics = job.parser, job.out, job.metrics
    send_events(job.sock, None, chat.finish(cut=len(out) >= job.max_tokens))  # cut: no open call
    job.t_end = time.perf_counter()
    decoded(agent, job)
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


def decoded(agent: DecodeAgent, job: Job) -> None:
    """A finished request's decode metrics; placement learns its step time
    (and a local prefill's rate)."""
    metrics, n_prompt, n_out = job.metrics, len(job.ids), len(job.out)
    decode_s = job.t_end - job.t_first
    prefill_s = metrics.prefill_time
    if metrics.method != "disaggregated" and prefill_s:
        agent.placement.observe_local(n_prompt - (metrics.cached_tokens or 0), prefill_s)
    if n_out > 1:
        agent.placement.observe_step(decode_s / (n_out - 1))
    metrics.completion_tokens = n_out
    # max_tokens here is the request's, capped by what the context leaves.
    called = bool(job.parser.tool_calls)
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
    frame = Done(
        "".join(chat.content),
        out,
        metrics,
        "".join(chat.reasoning),
        [WireCall(c.name, c.arguments, c.text) for c in chat.tool_calls],
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


def timeline(
    job: Job, local_span: tuple[float, float] | None, t_joined: float | None
) -> dict[str, float | None]:
    """A result's `timeline`, what `disagg serve`'s web view draws: `at`, the Unix
    time this agent took the request; the rest seconds after it, on this agent's
    clock (another host's clock never enters, so skew cannot bend a bar):
    prefill_start/prefill_end (remote: the PREFILL frame's send time plus the prefill
    agent's own queue and compute durations), kv_first/kv_last (K/V layers
    arriving), first_token, joined (entered the decode batch), done."""
    at, t0, marks, metrics = job.at, job.t0, job.marks, job.metrics

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 6)

    out: dict[str, float | None] = {"at": at}
    sent = marks.get("sent") if marks is not None else None
    if marks is not None and sent is not None:
        start = sent + float(metrics.prefill_queue_time or 0.0)
        out["prefill_start"] = rel(start)
        out["prefill_end"] = rel(start + float(metrics.prefill_time or 0.0))
        out["kv_first"], out["kv_last"] = rel(marks.get("kv_first")), rel(marks.get("kv_last"))
    elif local_span is not None:
        out["prefill_start"], out["prefill_end"] = rel(local_span[0]), rel(local_span[1])
    out.update(first_token=rel(job.t_first), joined=rel(t_joined), done=rel(job.t_end))
    return out

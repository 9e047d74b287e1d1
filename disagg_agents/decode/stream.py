"""The decode stage: the answer from its first token on, the rest decoded in the
loop's shared batch (disagg_agents.decode.loop), sent as the tokens come."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from disagg_agents.decode.job import Job
from disagg_agents.decode.loop import DecodeLoop, Seq
from disagg_agents.decode.tokenframes import bursts, corked, send_events
from disagg_agents.wire.channel import send_frame
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.request import GenerateRequest


def decode(loop: DecodeLoop, stops: Callable[[GenerateRequest], frozenset[int]], job: Job) -> None:
    """The answer as TOKEN (and LOGPROBS) frames as the tokens come (the first with
    `job.first_frame_metrics`): the tokens sent go to job.out, the batch row to
    job.seq (None: the answer ended with its first token)."""
    eos = stops(job.req)
    first, matcher = job.first_id, job.matcher
    if matcher is not None:
        matcher.consume(first)
        eos = eos | matcher.eos  # under a grammar EOS comes only where it accepts
    emit = emitter(job)
    if first in eos or job.max_tokens <= 1 or (matcher is not None and matcher.finished):
        for save in job.saves:
            save.now(job.caches)  # never decoded: nothing writes them
        if first not in eos:
            emit(first, job.first_logprobs)
        return
    req = job.req
    seq = Seq(job.caches, first, job.sampler, job.max_tokens, eos, req.logprobs, matcher=matcher)
    seq.tenant = req.cache_salt  # a full batch's free rows go fairly among tenants
    if req.speculate:  # drafts are looked up in what the model saw
        seq.context = job.prompt_ids
    for save in job.saves:
        save.attach(seq)
    loop.join(seq)
    job.seq = seq
    if job.progress is not None:
        job.progress.seq = seq  # PROGRESS now says queued (no batch slot yet) or decode
    try:
        emit(first, job.first_logprobs)
        for burst in bursts(seq.out):
            with corked(job.sock, len(burst) > 1):
                for tid, lp in burst:
                    emit(tid, lp)
            for save in job.saves:
                save.poll()  # joined a batch: its caches are free now
        for save in job.saves:
            save.finish()
    finally:
        seq.done = True  # a no-op when it ended; stops it if we failed
        for save in job.saves:
            save.drop()  # a no-op once saved


def emitter(job: Job) -> Callable[[int, np.ndarray | None], None]:
    """Sends one token: its TOKEN frames (the request's first with `job.first_frame_metrics`)
    and its LOGPROBS frame when asked."""
    out, chat, sock = job.out, job.parser, job.sock
    assert chat is not None  # opened by firsttoken

    def emit(tid: int, lp: np.ndarray | None) -> None:
        out.append(tid)
        send_events(sock, tid, chat.add(tid), None if out[1:] else job.first_frame_metrics)
        if lp is not None:
            send_frame(sock, Frame.LOGPROBS, lp.tobytes())

    return emit

"""The first-token stage: the first new token sampled from the prompt's last
logits (greedy read off them on the request's thread), the answer's parser
opened, and the prompt's prefix-cache saves made pending before it goes out."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from disagg_agents.decode.engine import DecodeEngine
from disagg_agents.decode.job import Job
from disagg_agents.decode.loop import DecodeLoop, Sampler, make_sampler, sample_rows
from disagg_agents.decode.prefixcache import DecodePrefixCache, Recording, Span
from disagg_agents.decode.prefixsave import PendingSave
from disagg_agents.decode.tokenframes import first_metrics


def first(engine: DecodeEngine, loop: DecodeLoop, prefix: DecodePrefixCache, job: Job) -> None:
    """The first token (job.first_id, job.first_logprobs), its time, the parser
    and the pending saves."""
    req, logits = job.req, job.logits
    assert logits is not None
    job.sampler = sampler = make_sampler(req.temperature, req.top_p, req.seed)
    if sampler is not None and job.resumed:
        loop.call(skip_draws, sampler, len(job.resumed))  # position len(resumed) draws next
    job.first_id, job.first_logprobs = pick_first(loop, logits, sampler, req.logprobs, job.allowed)
    job.t_first = time.perf_counter()
    if job.metrics.method != "disaggregated":
        job.metrics.prefill_time = job.t_first - job.t_local
    job.parser = parser = engine.stream(req, job.prompt_ids)
    for tid in job.resumed:
        parser.add(tid)  # sent by the agent that died: parsed, not sent again
    # The prompt's blocks are taken from the caches without a copy once
    # decoding stops writing them (disagg_agents.decode.prefixsave), pending from before
    # the first token goes out: a request that follows it finds them.
    job.saves = pending_saves(loop, prefix, job)
    job.first_frame_metrics = first_metrics(job.metrics, job.at, job.t0, job.t_first)


def pending_saves(loop: DecodeLoop, prefix: DecodePrefixCache, job: Job) -> list[PendingSave]:
    """The prefix saves this request makes; its recorded sliding layers are
    taken now, before any decode step (they turn plain)."""
    hits = [h for h in job.hits if h.keys and prefix.store.max_bytes]
    if not hits:
        return []
    caches = job.caches
    sliding: list[Span | None] = [None] * len(caches)
    if any(isinstance(c, Recording) for c in caches):
        sliding = loop.call(prefix.recorded, caches)
    return [PendingSave(prefix, loop, h, len(job.input_ids), sliding) for h in hits]


def pick_first(
    loop: DecodeLoop,
    logits: np.ndarray | mx.array,
    sampler: Sampler | None,
    want_logprobs: bool,
    allowed: np.ndarray | None,
) -> tuple[int, np.ndarray | None]:
    """The first new token and its logprobs: greedy is read off the logits on
    this thread (greedy_first), anything else sampled on the mlx thread."""
    greedy = sampler is None and not want_logprobs
    quick = greedy_first(np.asarray(logits), allowed) if greedy else None
    if quick is not None:
        return quick, None
    got: tuple[int, np.ndarray | None] = loop.call(
        first_token, logits, sampler, want_logprobs, allowed
    )
    return got


def skip_draws(sampler: Sampler, n: int) -> None:
    """Advance a sampler past `n` draws, as if it had sampled `n` tokens: a migrated
    seeded request then draws at each position what the seed gives there. mlx thread."""
    key = sampler.key
    for _ in range(n):
        key, _sub = mx.random.split(key)
    mx.eval(key)
    sampler.key = key


def first_token(
    logits: np.ndarray | mx.array,
    sampler: Sampler | None,
    want_logprobs: bool,
    allowed: np.ndarray | None = None,
) -> tuple[int, np.ndarray | None]:
    """The first new token, sampled from the prompt's last-position logits (the
    prefill side's, or a local prefill's) as mlx-lm's generate_step samples it;
    `allowed` ([vocab] bool): a grammar's mask for it. Runs on the mlx thread."""
    row = mx.array(logits).astype(mx.float32).reshape(1, -1)
    logprobs = row - mx.logsumexp(row, keepdims=True)
    pick = logprobs
    if allowed is not None:
        pick = mx.where(mx.array(allowed[: row.shape[-1]])[None], logprobs, -mx.inf)
    token = sample_rows(pick, [sampler])
    mx.eval(token, logprobs)
    tid = int(np.array(token)[0])
    return tid, np.array(logprobs[0]) if want_logprobs else None


def greedy_first(logits: np.ndarray, allowed: np.ndarray | None) -> int | None:
    """The greedy first token read off float32 logits on the request's own thread,
    with no turn of the decode loop (which may be mid-step or mid-chunk). The same
    token as first_token's argmax of logprobs unless the top two are so close that
    subtracting logsumexp could round them equal: None then, use first_token.
    Request thread; numpy only."""
    row = np.asarray(logits, np.float32).reshape(-1)
    if allowed is not None:
        row = np.where(allowed[: row.shape[0]], row, -np.inf)
    tid = int(np.argmax(row))
    top = float(row[tid])
    if not np.isfinite(top) or np.isnan(row).any():
        return None
    rest = np.delete(row, tid)
    gap = top - float(rest.max()) if rest.size else np.inf
    return tid if gap > 1e-5 * max(1.0, abs(top)) else None

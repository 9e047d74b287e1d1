"""The K/V stage: where the prompt's K/V comes from. A prefix cache hit, then a
remote prefill agent's stream (placed into the caches as it arrives) or the
model run here, chunked beside the decoding streams.

Work for a client that hung up stops at every step (HungUp): the wait for the
prefill agent (its connection closes, and that agent drops the prompt), the
fall back to a local prefill (refused), and a local prefill between chunks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from disagg_agents.decode.codectuner import CodecTuner, CodecTuners
from disagg_agents.decode.engine import DecodeEngine
from disagg_agents.decode.job import Job
from disagg_agents.decode.kvcaches import fill_layer
from disagg_agents.decode.kvfetch import DEFAULT_TIMEOUT_S, Into, PrefillUnavailable, fetch_kv
from disagg_agents.decode.kvslots import Slots, allocate
from disagg_agents.decode.loop import DecodeLoop
from disagg_agents.decode.placement import Placement
from disagg_agents.decode.prefixcache import DecodePrefixCache, Hit
from disagg_agents.prefix.store import Prefix
from disagg_agents.runtime.blasshare import BlasShare
from disagg_agents.runtime.hangup import HungUp, client_gone
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.kvcodec import Codec, LayerKV
from disagg_agents.wire.request import GenerateRequest, PrefillRequest

log = logging.getLogger("disagg.decode")


@dataclass
class KVSource:
    """What finding a prompt's K/V takes: the model (engine), the mlx thread
    (loop), the prefix cache, placement, the codec tuners and the BLAS share;
    who we are to prefill agents (name, token) and two live settings."""

    engine: DecodeEngine
    loop: DecodeLoop
    prefix: DecodePrefixCache
    placement: Placement
    tuners: CodecTuners
    blas_share: BlasShare
    name: str
    token: bytes | None = None  # the cluster token, proves us to prefill agents
    allow_mixed: bool = False  # accept a prefill agent on other weights ("mixed")
    kv_inplace: bool = True  # receive K/V straight into the caches (False: copy)

    def prompt_kv(self, job: Job) -> None:
        """The stage: job.caches holding the prompt and job.logits (prompt_kv)."""
        prompt_kv(self, job)


def prompt_kv(src: KVSource, job: Job) -> None:
    """Caches holding the prompt and the logits of its last position: fetched from
    the request's prefill agent, or prefilled here (local_prefill)."""
    fetch_or_not(src, job)
    job.t_local = time.perf_counter()
    if job.logits is None:
        job.logits = local_prefill(src, job)
    job.t_prefilled = time.perf_counter()


def fetch_or_not(src: KVSource, job: Job) -> None:
    """Fresh caches and, after a remote prefill, the prompt in them and the logits
    of its last position (None: prefill here). Picks the codec, looks up the prefix
    cache, decides where to prefill and fetches the K/V; a prefix cache hit is
    appended to `job.hits`, to save the prompt's blocks later."""
    req, ids, metrics = job.req, job.input_ids, job.metrics
    job.caches = make_prompt_cache(src.engine.model)
    if req.prefill is None:
        metrics.method = "decode-only"
        return
    key = f"{','.join(req.prefill.hosts)}:{req.prefill.port}"
    codec, tuner, probe = pick_codec(src, req, key, metrics)
    where, why, hit = place(src, req, key, ids)
    metrics.update(placement=where, placement_reason=why)
    if where == "local":
        metrics.method = "local"
        return
    try:
        fetched, logits = fetch_remote(src, job, hit, codec, probe)
    except PrefillUnavailable as e:
        if gone(job)():  # the wait outlasted its client: nobody to prefill for
            raise HungUp(f"the client hung up; no local prefill after: {e}") from None
        log.warning("%s; prefilling locally", e)
        metrics.update(method="local-fallback", fallback_reason=str(e), fallback_kind=e.kind)
        job.caches = make_prompt_cache(src.engine.model)
        return
    job.marks = fetched.pop("marks", None)  # this host's clock, for the timeline only
    # Rates from what was computed and sent, not what came from a prefix cache.
    computed = len(ids) - max(hit.tokens if hit.used else 0, fetched["prefill_cached_tokens"])
    src.placement.observe_remote(key, computed, len(job.caches), fetched)
    fetched.pop("prefill_queue_waiting", None)  # other requests' count: not the client's
    if tuner is not None:
        tuner.observe_fetch(fetched)
    metrics.update(fetched, method="disaggregated", cached_tokens=hit.tokens if hit.used else 0)
    metrics.disk_cached_tokens = hit.disk_tokens if hit.used else None
    job.hits.append(hit)
    job.logits = logits


def lookup(src: KVSource, req: GenerateRequest, namespace: str, ids: list[int], local: bool) -> Hit:
    """The prefix cache's hit for `ids` in `namespace` (none when the request
    turned the cache off)."""
    if not req.prefix_cache or req.kv_quant:  # int8 K/V is lossy: never reused
        return Hit(namespace, [], [], src.prefix.store.block)
    return src.prefix.lookup(namespace, ids, local, req.cache_salt)


def pick_codec(
    src: KVSource, req: GenerateRequest, key: str, metrics: Metrics
) -> tuple[Codec, CodecTuner | None, bool]:
    """The K/V codec to ask the prefill agent `key` for: the request's, or for
    "auto" what that link measured best. Also the tuner that learns from this
    fetch, and whether to time the other codecs on one layer."""
    if req.codec != "auto":
        return Codec(int(req.codec)), None, False
    tuner = src.tuners.for_link(key)
    codec, why = tuner.choose()
    metrics.codec_reason = why
    return codec, tuner, tuner.wants_probe()


def place(src: KVSource, req: GenerateRequest, key: str, ids: list[int]) -> tuple[str, str, Hit]:
    """Where the prompt is prefilled ("local" or "remote"), why, and the remote
    prefix cache hit. The hit comes first: placement then weighs only what a
    remote prefill still computes and sends (most of a chat's next turn hits)."""
    namespace = remote_namespace(src, req)
    hit = Hit(namespace, [], [], src.prefix.store.block)
    if req.placement != "local":
        hit = lookup(src, req, namespace, ids, local=False)
    where, why = src.placement.choose(key, len(ids), cached=hit.tokens)
    if req.placement in ("local", "remote"):
        where, why = req.placement, "placement forced by the request"
    return where, why, hit


def remote_namespace(src: KVSource, req: GenerateRequest) -> str:
    """The prefix cache's namespace for K/V from the request's prefill agent: its
    host, not its port, so blocks (on disk too) outlive the prefill agent's restart
    on a new port. With mixed weights allowed, another agent there may hold other
    weights: then the port too."""
    assert req.prefill is not None
    where = ",".join(req.prefill.hosts)
    return f"remote:{where}:{req.prefill.port}" if src.allow_mixed else f"remote:{where}"


def hello(src: KVSource) -> dict[str, Any]:
    """Our HELLO to a prefill agent: who we are and the model we decode."""
    return {
        "role": "decode",
        "fingerprint": src.engine.fingerprint,
        "model": src.engine.model_dir,
        "server": src.name,
        "allow_mixed": src.allow_mixed,
    }


def fetch_remote(
    src: KVSource, job: Job, hit: Hit, codec: Codec, probe: bool
) -> tuple[dict[str, Any], np.ndarray]:
    """The prompt's K/V from the request's prefill agent, placed into `job.caches`
    (past a prefix cache `hit`), and its last position's logits; the fetch's
    metrics (kvfetch.fetch_metrics). Raises PrefillUnavailable."""
    assert job.req.prefill is not None
    fills: list[Future[Any]] = []
    # Full-attention layers are received straight into their caches, which
    # the mlx thread allocates while we dial (disagg_agents.decode.kvslots).
    alloc = allocating(src, job)
    prefix = src.prefix.remote_prefix(hit, job.input_ids)
    ask = prefill_ask(src, job, codec, probe, prefix)
    with src.blas_share.prefilling():
        slots = slots_of(src, alloc, hit) if alloc is not None else None
        into = Into(job.caches, placer(src, alloc, fills), prefix, slots, gone(job))
        fetched, logits = fetch_kv(
            job.req.prefill, ask, into, hello(src), src.token, src.engine.vocab_size
        )
    for f in fills:
        f.result()
    placed = alloc.result() if alloc is not None else None
    fetched["kv_inplace_layers"] = len(placed.placed) if placed is not None else 0
    if placed is not None:
        placed.release()  # so decoding updates the caches in place
    return fetched, logits


def allocating(src: KVSource, job: Job) -> Future[Slots] | None:
    """The in-place receive's cache buffers, allocated on the mlx thread (None:
    the copy path)."""
    if not src.kv_inplace:
        return None
    fp = src.engine.fingerprint
    return src.loop.post(
        allocate,
        job.caches,
        len(job.input_ids),
        src.engine.dtype,
        fp["num_kv_heads"],
        fp["head_dim"],
    )


def slots_of(src: KVSource, alloc: Future[Slots], hit: Hit) -> Callable[[], Slots]:
    """fetch_kv's `slots`: the allocated buffers, a prefix hit's blocks copied in."""

    def slots() -> Slots:
        got: Slots = alloc.result()
        if hit.tokens:
            got.prefix_start = hit.tokens
            got.fill_prefix = lambda layer, k, v: src.prefix.fill_prefix(hit, layer, k, v)
        return got

    return slots


def placer(
    src: KVSource, alloc: Future[Slots] | None, fills: list[Future[Any]]
) -> Callable[[Any, LayerKV, int], None]:
    """fetch_kv's `place`: a layer not received in place, copied into its cache on
    the mlx thread (the futures go to `fills`)."""

    def place(cache: Any, kv: LayerKV, prompt_len: int) -> None:
        if alloc is not None and kv.layer in alloc.result().placed:
            return  # received into its cache already
        # A copy: the reader reuses its buffer for the next layer at once
        # (a layer extended with a cached prefix is a new array already).
        own = kv
        if not (kv.keys.flags.owndata and kv.values.flags.owndata):
            own = LayerKV(kv.layer, kv.kind, kv.dtype, kv.keys.copy(), kv.values.copy())
        fills.append(src.loop.post(fill_layer, cache, own, prompt_len))

    return place


def prefill_ask(
    src: KVSource, job: Job, codec: Codec, probe: bool, prefix: Prefix | None
) -> PrefillRequest:
    """The PREFILL frame's request: the prompt past the prefix the prefill agent
    holds too, and whether our cores are busy."""
    req = job.req
    return PrefillRequest(
        job.input_ids,
        codec=int(codec),
        kv_quant=req.kv_quant,
        start=prefix.start if prefix else 0,
        prefix_digest=prefix.digest if prefix else None,
        prefix_cache=req.prefix_cache,
        probe_codecs=probe,
        cache_salt=req.cache_salt,
        # Only where the agents share cores (blas_share set up by localagents):
        # rows decoding now, or prefills of ours ahead of this one, whose
        # streams will be decoding by the time this one runs.
        cores_busy=src.blas_share.shared is not None
        and (src.loop.busy() or src.blas_share.prefills > 0),
        # As long as we wait for its first K/V (kvfetch.open_session's timeout).
        wait_s=(req.prefill.timeout if req.prefill else None) or DEFAULT_TIMEOUT_S,
    )


def local_prefill(src: KVSource, job: Job) -> np.ndarray:
    """The prompt through the model here. Alone, chunked exactly as mlx-lm's
    generate_step does (so the text matches it); beside decoding streams, in
    chunks the loop sizes to about a decode step or two, a step between each
    (disagg_agents/decode/chunksizer.py), so no stream stalls for the whole prompt. Returns the
    last position's logits (float32). A prefix cache hit (mlx's own K/V, namespace
    "local") seeds the caches and only the rest is computed."""
    model, ids, caches = src.engine.model, job.input_ids, job.caches
    left = gone(job)
    if left():
        raise HungUp("the client hung up before its local prefill began")
    done = seed_local(src, job)

    def chunk(a: int, b: int) -> None:
        if left():  # on the mlx thread, between chunks: the request's thread gets it
            raise HungUp(f"the client hung up; local prefill stopped at {a} of {len(ids)}")
        model(mx.array(ids[a:b])[None], cache=caches)
        mx.eval([c.state for c in caches])
        if b - a > 256:
            mx.clear_cache()  # as generate_step does: a big chunk's activations are large

    def last() -> np.ndarray:
        logits = model(mx.array(ids[-1:])[None], cache=caches)[:, -1, :]
        row = logits[0].astype(mx.float32)  # what first_token samples from
        mx.eval(row)
        return np.array(row)

    if done < len(ids) - 1:
        src.loop.prefill(chunk, done, len(ids) - 1).result()
    logits: np.ndarray = src.loop.call(last)
    return logits


def gone(job: Job) -> Callable[[], bool]:
    """Whether the request's client has hung up (never, for a job without one)."""
    sock = job.sock
    if sock is None:
        return lambda: False
    return lambda: client_gone(sock)


def seed_local(src: KVSource, job: Job) -> int:
    """The local prefix cache's hit seeded into the caches: the prompt positions
    it covers (0: none)."""
    hit = lookup(src, job.req, "local", job.input_ids, local=True)
    job.hits.append(hit)
    src.prefix.record(hit, job.caches)  # a sliding layer's every position, to save
    if hit.tokens:
        src.loop.call(src.prefix.seed, hit, job.caches)
    job.metrics.cached_tokens = hit.tokens
    job.metrics.disk_cached_tokens = hit.disk_tokens or None
    return hit.tokens

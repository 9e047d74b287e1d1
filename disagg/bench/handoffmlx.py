"""The wire bench's receiver as the decode agent receives: K/V into mlx caches.

Two modes, run in the receiving process (`handoffrecv.main`):
  - inplace: the mlx thread allocates the request's caches before the clock
    starts (the agent posts that before it dials, so it overlaps the prefill),
    then `kvfetch.receive_layers` with `kvinplace` slots writes every layer
    straight into them, and the slots are released, as `disagg_agents.decode` does;
  - mlx_copy: the copy path (DISAGG_KV_INPLACE=0): each layer decoded into the
    reader's buffer, copied, and put into its cache by `fill_layer` on the mlx
    thread.
The ack goes out once the last layer is in mlx memory. With `verify`, the
receiver hashes the caches' first prompt_len positions as mlx holds them.
"""

from __future__ import annotations

import hashlib
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from disagg.bench.handoff import Spec
from disagg_agents.decode.kvcaches import fill_layer
from disagg_agents.decode.kvfetch import Into, receive_layers
from disagg_agents.decode.kvslots import Slots, allocate
from disagg_agents.wire.kvcodec import LayerKV
from disagg_agents.wire.request import PrefillRequest

MODES = ("inplace", "mlx_copy")


def cache_digest(caches: list[Any], prompt_len: int) -> str:
    """sha256 of every cache's K then V, [H, prompt_len, D] each, as mlx holds
    them (bf16 as its 16-bit words): comparable with handoff.kv_digest."""
    h = hashlib.sha256()
    for cache in caches:
        for a in (cache.keys, cache.values):
            part = a[0, :, :prompt_len, :]
            if part.dtype == mx.bfloat16:
                part = part.view(mx.uint16)
            h.update(np.ascontiguousarray(np.array(part)).tobytes())
    return h.hexdigest()


class MlxReceiver:
    """One thread owns mlx (the decode loop's, in the agent)."""

    def __init__(self) -> None:
        self.mlx = ThreadPoolExecutor(1, thread_name_prefix="mlx")

    def close(self) -> None:
        self.mlx.shutdown()

    def prepare(self, mode: str, spec: Spec) -> Transfer:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        caches = [KVCache() for _ in range(spec.layers)]
        alloc: Future[Slots] | None = None
        alloc_s = 0.0
        if mode == "inplace":
            t0 = time.perf_counter()
            alloc = self.mlx.submit(allocate, caches, spec.tokens, spec.dtype, spec.heads, spec.dim)
            alloc.result()
            alloc_s = time.perf_counter() - t0
        # Made before the clock, as the decode agent makes it before it dials.
        request = PrefillRequest(list(range(spec.tokens)))
        return Transfer(self.mlx, spec, caches, alloc, alloc_s, request)


@dataclass
class Transfer:
    mlx: ThreadPoolExecutor
    spec: Spec
    caches: list[Any]
    alloc: Future[Slots] | None
    alloc_s: float
    request: PrefillRequest

    def receive(self, sock: socket.socket, verify: bool) -> dict[str, Any]:
        """Take one PREFILL stream into the caches; what the sender's answer carries."""
        fills: list[Future[Any]] = []
        alloc = self.alloc

        def place(cache: Any, kv: LayerKV, prompt_len: int) -> None:
            if alloc is not None and kv.layer in alloc.result().placed:
                return  # received into its cache already
            own = LayerKV(kv.layer, kv.kind, kv.dtype, kv.keys.copy(), kv.values.copy())
            fills.append(self.mlx.submit(fill_layer, cache, own, prompt_len))

        spec = self.spec
        fp = {"num_kv_heads": spec.heads, "head_dim": spec.dim}
        slots = alloc.result if alloc is not None else None
        # Packed ids, as to a prefill agent whose HELLO_OK offers them.
        receive_layers(sock, self.request, Into(self.caches, place, None, slots), fp, None, True)
        for f in fills:
            f.result()
        placed = 0
        if alloc is not None:
            placed = len(alloc.result().placed)
            alloc.result().release()  # so decoding would update the caches in place
        digest = None
        if verify:
            digest = self.mlx.submit(cache_digest, self.caches, spec.tokens).result()
        return {"digest": digest, "placed": placed, "alloc_s": self.alloc_s}

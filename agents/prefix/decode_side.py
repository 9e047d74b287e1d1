"""The decode agent's prefix cache: prompt K/V that a prefill produced, kept as
numpy blocks, and how a hit seeds a request's mlx caches.

Only prompt positions are stored, never decoded tokens, and K/V from different
producers never mix: each prefill agent (torch) and the local prefill (mlx)
have their own namespace, so a hit joins K/V that the same producer computed,
which is what that producer's cache-off run computes (checked by the tests).

Sliding-window layers are never stored. A remote hit is capped so that every
position a sliding layer keeps (the last window-1) is in the suffix the prefill
agent sends anyway; a local prefill of a model with sliding layers is never
served from the cache (mlx's rotating buffer would need the window at the hit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from ..kvcodec import DTYPE_NAMES, Kind, LayerKV
from .store import Block, Prefix, PrefixCache, block_keys, prefix_digest


@dataclass
class Hit:
    """One request's lookup: its block keys, and the cached blocks that start it."""

    namespace: str
    keys: list[bytes]
    blocks: list[Block]
    block: int
    tokens: int = 0  # cached prompt positions the request reuses
    used: bool = False  # a layer was extended with them (an older prefill agent sends all)
    kept: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = len(self.blocks) * self.block


class DecodePrefix:
    """The decode side's cache for one model. `kinds`: the fingerprint's layers."""

    def __init__(self, max_bytes: int, kinds: list[list[Any]], dtype: str) -> None:
        self.cache = PrefixCache(max_bytes)
        self.full = [k[0] == "full" for k in kinds]
        self.window = max((int(k[1]) for k in kinds if k[0] != "full"), default=0)
        self.dtype = DTYPE_NAMES[dtype]

    def lookup(self, namespace: str, ids: list[int], local: bool, salt: str | None = None) -> Hit:
        """The longest usable cached prefix of `ids` (a miss: tokens 0). The last
        prompt token is always computed: its logits start the decode."""
        cap = len(ids) - 1
        if self.window:
            cap = -1 if local else min(cap, len(ids) - self.window)
        b = self.cache.block
        keys = block_keys(ids, namespace, b, salt)
        blocks = self.cache.longest(keys, cap // b) if cap > 0 and self.cache.max_bytes else []
        hit = Hit(namespace, keys, blocks, b)
        self.cache.record(len(ids), hit.tokens)
        return hit

    def prefix_layer(self, hit: Hit, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """[H, hit.tokens, D] keys and values of a full layer, from the blocks."""
        parts = [blk.layers[layer] for blk in hit.blocks]
        assert all(p is not None for p in parts)
        keys = np.concatenate([p[0] for p in parts if p is not None], axis=1)
        values = np.concatenate([p[1] for p in parts if p is not None], axis=1)
        return keys, values

    def remote_prefix(self, hit: Hit, ids: list[int]) -> Prefix | None:
        if not hit.tokens:
            return None

        def extend(kv: LayerKV) -> LayerKV:
            hit.used = True
            keys, values = self.prefix_layer(hit, kv.layer)
            return LayerKV(
                kv.layer,
                kv.kind,
                kv.dtype,
                np.concatenate([keys, kv.keys], axis=1),
                np.concatenate([values, kv.values], axis=1),
                kv.quant,
            )

        return Prefix(hit.tokens, prefix_digest(ids[: hit.tokens]), extend)

    # -- receive in place (agents.kvinplace) ---------------------------------------

    def fill_prefix(self, hit: Hit, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Copy the hit's blocks of a full layer into `keys`/`values` ([H, hit.tokens, D]
        views of its cache), block by block: no concatenated copy."""
        hit.used = True
        b = hit.block
        for i, blk in enumerate(hit.blocks):
            part = blk.layers[layer]
            assert part is not None
            keys[:, i * b : (i + 1) * b] = part[0]
            values[:, i * b : (i + 1) * b] = part[1]

    # ------------------------------------------------------------------------------

    def keep(self, hit: Hit, kv: LayerKV, prompt_len: int) -> None:
        """Hold a whole full-attention layer (a private copy, or views of its
        cache when received in place) to store after the fetch."""
        if self.full[kv.layer] and kv.keys.shape[1] == prompt_len and kv.quant is None:
            hit.kept[kv.layer] = (kv.keys, kv.values)

    def store(self, hit: Hit) -> None:
        """Store the request's blocks from the layers it kept (all full layers, or nothing)."""
        if not self.cache.max_bytes or len(hit.kept) != sum(self.full):
            hit.kept.clear()  # views of a cache must not outlive the fetch (kvinplace)
            return
        b = self.cache.block

        def make(i: int) -> Block:
            layers: list[tuple[Any, Any] | None] = []
            size = 0
            for layer in range(len(self.full)):
                if layer not in hit.kept:
                    layers.append(None)
                    continue
                k, v = hit.kept[layer]
                # Copies: a view would keep the request's whole array alive.
                pair = (k[:, i * b : (i + 1) * b].copy(), v[:, i * b : (i + 1) * b].copy())
                size += pair[0].nbytes + pair[1].nbytes
                layers.append(pair)
            return Block(tuple(layers), size)

        self.cache.add(hit.keys, make)
        hit.kept.clear()

    # -- local prefill: mlx work, on the mlx thread ------------------------------

    def seed(self, hit: Hit, caches: list[Any]) -> None:
        """Fill every (full-attention) cache with the hit's prefix."""
        from ..kvplace import fill_layer

        for layer, cache in enumerate(caches):
            keys, values = self.prefix_layer(hit, layer)
            fill_layer(cache, LayerKV(layer, Kind.FULL, self.dtype, keys, values), hit.tokens)

    def keep_caches(self, hit: Hit, caches: list[Any], prompt_len: int) -> None:
        """Hold the prompt's K/V from mlx caches just prefilled (before any decode step)."""
        for layer, cache in enumerate(caches):
            if self.full[layer]:
                hit.kept[layer] = (
                    to_numpy(cache.keys[0, :, :prompt_len]),
                    to_numpy(cache.values[0, :, :prompt_len]),
                )


def to_numpy(a: mx.array) -> np.ndarray:
    """An mx array as numpy in the wire dtype (bf16 as raw 16-bit words)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)

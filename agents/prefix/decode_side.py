"""The decode agent's prefix cache: prompt K/V that a prefill produced, kept as
numpy blocks, and how a hit seeds a request's mlx caches.

Only prompt positions are stored, never decoded tokens, and K/V from different
producers never mix: each prefill agent (torch) and the local prefill (mlx)
have their own namespace, so a hit joins K/V that the same producer computed,
which is what that producer's cache-off run computes (checked by the tests).

Blocks are copied straight out of the request's own caches once its first token
is out (`views` then `store`): nothing else holds the prompt's K/V meanwhile.

Sliding-window layers: a remote prefill sends only a sliding layer's last
window-1 positions, so remote blocks keep full-attention layers only and a
remote hit is capped so that every position a sliding layer keeps is in the
suffix the prefill agent sends anyway. A local prefill records every position of
its sliding layers as it computes them (`Recording`), so local blocks keep every
layer and a local hit seeds a sliding layer with the window before the hit's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from ..kvcodec import DTYPE_NAMES, Kind, LayerKV
from .store import Block, Prefix, PrefixCache, block_keys, prefix_digest


@dataclass
class Span:
    """One layer's prompt K/V to store from: [H, S, D] keys and values (views of
    a cache are fine: `store` copies what it keeps) for positions start..start+S."""

    keys: np.ndarray
    values: np.ndarray
    start: int = 0


@dataclass
class Hit:
    """One request's lookup: its block keys, and the cached blocks that start it."""

    namespace: str
    keys: list[bytes]
    blocks: list[Block]
    block: int
    tokens: int = 0  # cached prompt positions the request reuses
    used: bool = False  # a layer was extended with them (an older prefill agent sends all)

    def __post_init__(self) -> None:
        self.tokens = len(self.blocks) * self.block


class Recording(RotatingKVCache):
    """A sliding layer's cache during a local prefill that will be stored: mlx's
    rotating buffer keeps only the window, so every update's new K/V is kept
    here too (the arrays mlx computed, not copies) until the store."""

    def __init__(self, max_size: int, keep: int = 0) -> None:
        super().__init__(max_size, keep)
        self.recorded: list[tuple[mx.array, mx.array]] = []
        self.start = 0  # the position of the first recorded one

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self.recorded.append((keys, values))
        return super().update_and_fetch(keys, values)

    def plain(self) -> RotatingKVCache:
        """The same state as a plain RotatingKVCache (what the batch decodes)."""
        out = RotatingKVCache(self.max_size, self.keep)
        out.state = self.state
        return out


class DecodePrefix:
    """The decode side's cache for one model. `kinds`: the fingerprint's layers."""

    def __init__(self, max_bytes: int, kinds: list[list[Any]], dtype: str) -> None:
        self.cache = PrefixCache(max_bytes)
        self.full = [k[0] == "full" for k in kinds]
        self.windows = [0 if k[0] == "full" else int(k[1]) for k in kinds]
        self.window = max(self.windows, default=0)
        self.dtype = DTYPE_NAMES[dtype]

    def lookup(self, namespace: str, ids: list[int], local: bool, salt: str | None = None) -> Hit:
        """The longest usable cached prefix of `ids` (a miss: tokens 0). The last
        prompt token is always computed: its logits start the decode."""
        cap = len(ids) - 1
        if self.window and not local:
            cap = min(cap, len(ids) - self.window)
        b = self.cache.block
        keys = block_keys(ids, namespace, b, salt)
        blocks = self.cache.longest(keys, cap // b) if cap > 0 and self.cache.max_bytes else []
        if blocks and local and any(blocks[0].layers[i] is None for i in range(len(self.full))):
            blocks = []  # not every layer kept: cannot seed a local prefill
        hit = Hit(namespace, keys, blocks, b)
        self.cache.record(len(ids), hit.tokens)
        return hit

    def prefix_layer(self, hit: Hit, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """[H, n, D] keys and values of a layer at the hit's end: every cached
        position for a full layer, the last window for a sliding one (what
        mlx's rotating buffer holds after a chunk of n tokens, trimmed and
        rotated by the next step exactly as in a run without the cache)."""
        n, b = hit.tokens, hit.block
        first = max(0, n - self.windows[layer]) if self.windows[layer] else 0
        parts = [blk.layers[layer] for blk in hit.blocks[first // b :]]
        assert all(p is not None for p in parts)
        keys = np.concatenate([p[0] for p in parts if p is not None], axis=1)
        values = np.concatenate([p[1] for p in parts if p is not None], axis=1)
        skip = first - first // b * b
        return keys[:, skip:], values[:, skip:]

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

    def store(self, hit: Hit, spans: list[Span | None]) -> int:
        """Store the request's new blocks from `spans` (per layer, None: not
        there). Every full layer is needed; sliding ones too for a local hit's
        namespace, else nothing is stored. Copies block by block, so no second
        whole copy of the prompt exists at any time. Returns the bytes added."""
        if not self.cache.max_bytes or not hit.keys:
            return 0
        local = hit.namespace == "local"
        need = [f or (local and bool(w)) for f, w in zip(self.full, self.windows, strict=True)]
        if any(n and s is None for n, s in zip(need, spans, strict=True)):
            return 0
        b = self.cache.block

        def make(i: int) -> Block | None:
            layers: list[tuple[Any, Any] | None] = []
            size = 0
            for layer, span in enumerate(spans):
                if span is None or not need[layer]:
                    layers.append(None)
                    continue
                lo = i * b - span.start
                if lo < 0 or lo + b > span.keys.shape[1]:
                    return None  # not held (its cached block went meanwhile)
                # Copies: a view would keep the request's whole array alive.
                pair = (span.keys[:, lo : lo + b].copy(), span.values[:, lo : lo + b].copy())
                size += pair[0].nbytes + pair[1].nbytes
                layers.append(pair)
            return Block(tuple(layers), size)

        return self.cache.add(hit.keys, make)

    def record(self, hit: Hit, caches: list[Any]) -> None:
        """Before a local prefill that will be stored: its sliding layers'
        caches (still empty) become `Recording`s."""
        if not hit.keys or not self.cache.max_bytes:
            return
        for layer, cache in enumerate(caches):
            if type(cache) is RotatingKVCache and cache.keys is None:
                caches[layer] = Recording(cache.max_size, cache.keep)
                caches[layer].start = hit.tokens

    # -- mlx work, on the mlx thread ---------------------------------------------

    def seed(self, hit: Hit, caches: list[Any]) -> None:
        """Fill every cache with the hit's prefix, as if mlx had prefilled it
        in one chunk: a sliding layer with the window before its end."""
        from ..kvplace import fill_layer

        for layer, cache in enumerate(caches):
            keys, values = self.prefix_layer(hit, layer)
            kind = Kind.FULL if self.full[layer] else Kind.SLIDING
            fill_layer(cache, LayerKV(layer, kind, self.dtype, keys, values), hit.tokens)

    def views(self, caches: list[Any], prompt_len: int) -> list[Span | None]:
        """Spans over the prompt's K/V in `caches` right after its prefill, before
        any decode step (full layers: views of mlx's arrays, no copy; a
        `Recording` sliding layer: what it recorded, then it turns plain)."""
        out: list[Span | None] = []
        for layer, cache in enumerate(caches):
            if isinstance(cache, Recording):
                ks, vs = [k for k, _ in cache.recorded], [v for _, v in cache.recorded]
                caches[layer] = cache.plain()
                if not ks:
                    out.append(None)
                    continue
                keys, values = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
                mx.eval(keys, values)
                out.append(Span(as_numpy(keys)[0], as_numpy(values)[0], cache.start))
            elif self.full[layer] and cache.keys is not None and cache.offset >= prompt_len:
                out.append(
                    Span(
                        as_numpy(cache.keys)[0, :, :prompt_len],
                        as_numpy(cache.values)[0, :, :prompt_len],
                    )
                )
            else:
                out.append(None)
        return out


def as_numpy(a: mx.array) -> np.ndarray:
    """An evaluated mx array as numpy in the wire dtype (bf16 as raw 16-bit
    words), sharing its memory: valid while the array is not written."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.asarray(a)

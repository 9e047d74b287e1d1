"""The decode agent's prefix cache: prompt K/V that a prefill produced, kept as
numpy blocks, and how a hit seeds a request's mlx caches.

Only prompt positions are stored, never decoded tokens, and K/V from different
producers never mix: each prefill agent (torch) and the local prefill (mlx)
have their own namespace, so a hit joins K/V that the same producer computed,
which is what that producer's cache-off run computes (checked by the tests).

Blocks are taken from the request's own caches without a copy, once the decode
loop stops writing them (disagg_agents.decode.prefixsave): at the request's end, or when it
joins a batch (whose merge copies them anyway). They are then numpy views of
the cache buffers, which the cache holds whole (`Owner`: the budget counts the
buffers, decoded positions and headroom included); where the new blocks would be
less than half of those buffers (a hit's short suffix, a long decode), they are
copied out instead. A view is never taken of a cache that is still written:
mlx may replace a buffer it cannot update in place, and a view would then
read freed memory.

Sliding-window layers: a remote prefill sends only a sliding layer's last
window-1 positions, so remote blocks keep full-attention layers only and a
remote hit is capped so that every position a sliding layer keeps is in the
suffix the prefill agent sends anyway. A local prefill records every position of
its sliding layers as it computes them (`Recording`), so local blocks keep every
layer and a local hit seeds a sliding layer with the window before the hit's end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from disagg_agents.prefix.blockfile import max_file_bytes
from disagg_agents.prefix.disk import DiskTier, fingerprint_digest
from disagg_agents.prefix.store import Block, BlockStore, Owner, Prefix, block_keys, prefix_digest
from disagg_agents.wire.kvcodec import DTYPE_NAMES, Kind, LayerKV

# Blocks are kept as views only where they are at least this share of the
# memory the views would hold; else they are copied out.
VIEW_SHARE = 0.5


@dataclass
class Span:
    """One layer's prompt K/V to save from: [H, S, D] keys and values for
    positions start..start+S. `save` may keep views of them: they must never be
    written again (a released cache, or arrays made for the save)."""

    keys: np.ndarray
    values: np.ndarray
    start: int = 0


def held_bytes(arrays: list[np.ndarray]) -> int:
    """The memory that views of `arrays` keep alive: each one's whole underlying
    buffer (a cache's capacity, not just the prompt), counted once."""
    roots: dict[int, int] = {}
    for a in arrays:
        root: Any = a
        top = a  # the last numpy array on the way: all of a foreign root it exports
        while isinstance(root, np.ndarray) and root.base is not None:
            top, root = root, root.base
        try:
            roots[id(root)] = memoryview(root).nbytes  # an mlx array, bytes, numpy's own
        except TypeError:  # no buffer protocol (a torch tensor)
            roots[id(root)] = top.nbytes
    return sum(roots.values())


@dataclass
class Hit:
    """One request's lookup: its block keys, and the cached blocks that start it."""

    namespace: str
    keys: list[bytes]
    blocks: list[Block]
    block: int
    tokens: int = 0  # cached prompt positions the request reuses
    used: bool = False  # a layer was extended with them (an older prefill agent sends all)
    disk_blocks: int = 0  # of `blocks`, the last ones: read back from the disk tier

    def __post_init__(self) -> None:
        self.tokens = len(self.blocks) * self.block

    @property
    def disk_tokens(self) -> int:
        return self.disk_blocks * self.block


class Recording(RotatingKVCache):
    """A sliding layer's cache during a local prefill that will be stored: mlx's
    rotating buffer keeps only the window, so every update's new K/V is kept
    here too (the arrays mlx computed, not copies) until the save."""

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


class DecodePrefixCache:
    """The decode side's cache for one model. `kinds`: the fingerprint's layers."""

    def __init__(self, max_bytes: int, kinds: list[list[Any]], dtype: str) -> None:
        self.store = BlockStore(max_bytes)
        self.full = [k[0] == "full" for k in kinds]
        self.windows = [0 if k[0] == "full" else int(k[1]) for k in kinds]
        self.window = max(self.windows, default=0)
        self.dtype = DTYPE_NAMES[dtype]
        # Stores waiting for their request's caches (disagg_agents.decode.prefixsave).
        self.pending: list[Any] = []
        self.pending_lock = threading.Lock()
        self.disk: DiskTier | None = None  # blocks kept across restarts (enable_disk)

    def enable_disk(
        self, root: str, max_bytes: int, fingerprint: dict[str, Any], secret: bytes | None
    ) -> None:
        """Keep blocks in `root` too (at most `max_bytes`), for this model only;
        `secret` (the cluster token) keys the files' MAC."""
        most = max_file_bytes(fingerprint, self.store.block)
        self.disk = DiskTier(root, max_bytes, fingerprint_digest(fingerprint), secret, most)

    def pending_add(self, save: Any) -> None:
        with self.pending_lock:
            self.pending.append(save)

    def pending_remove(self, save: Any) -> None:
        with self.pending_lock:
            if save in self.pending:
                self.pending.remove(save)

    def _take_pending(self, keys: list[bytes], have: int, most: int) -> bool:
        """Run the pending saves that hold more of `keys` than the cache's
        `have` blocks (up to `most`). True if any ran."""
        if have >= most:
            return False
        with self.pending_lock:
            better = [p for p in self.pending if p.keys[: have + 1] == keys[: have + 1]]
        for p in better:
            p.take_now()
        return bool(better)

    def lookup(self, namespace: str, ids: list[int], local: bool, salt: str | None = None) -> Hit:
        """The longest usable cached prefix of `ids` (a miss: tokens 0). The last
        prompt token is always computed: its logits start the decode."""
        cap = len(ids) - 1
        if self.window and not local:
            cap = min(cap, len(ids) - self.window)
        b = self.store.block
        keys = block_keys(ids, namespace, b, salt)
        blocks = self.store.longest(keys, cap // b) if cap > 0 and self.store.max_bytes else []
        if cap > 0 and self._take_pending(keys, len(blocks), min(cap // b, len(keys))):
            blocks = self.store.longest(keys, cap // b)  # a request still decoding had more
        if blocks and local and any(blocks[0].layers[i] is None for i in range(len(self.full))):
            blocks = []  # not every layer kept: cannot seed a local prefill
        n_memory = len(blocks)
        if cap > 0:
            blocks += self._from_disk(keys, n_memory, cap // b, local)
        hit = Hit(namespace, keys, blocks, b, disk_blocks=len(blocks) - n_memory)
        self.store.record(len(ids), hit.tokens)
        if self.disk is not None and hit.disk_blocks:
            self.disk.count_hit(hit.disk_tokens)
        return hit

    def _from_disk(self, keys: list[bytes], have: int, most: int, local: bool) -> list[Block]:
        """The blocks after the `have` in memory that the disk tier holds, in order
        until one is missing or unusable (a hole would strand the rest); they go
        into memory too, so the next turn finds them there."""
        if self.disk is None or not self.disk.max_bytes or have >= most:
            return []
        need = [f or local for f in self.full]
        found: list[Block] = []
        tenant = getattr(keys, "tenant", None)
        for k in keys[have:most]:
            blk = self.disk.get(k, tenant)
            if blk is None or len(blk.layers) != len(need):
                break
            if any(n and layer is None for n, layer in zip(need, blk.layers, strict=True)):
                break
            found.append(blk)
        if found and self.store.max_bytes:
            by_index = {have + i: blk for i, blk in enumerate(found)}
            self.store.add(keys[: have + len(found)], lambda i: by_index.get(i))
        return found

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

    # -- receive in place (disagg_agents.decode.kvslots) ---------------------------------------

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

    def save(self, hit: Hit, spans: list[Span | None]) -> int:
        """Store the request's new blocks from `spans` (per layer, None: not
        there). Every full layer is needed; sliding ones too for a local hit's
        namespace, else nothing is stored. Blocks are views of the spans' arrays
        (`VIEW_SHARE`), else copies made block by block, so no second whole copy
        of the prompt exists at any time. Returns the bytes added."""
        if not self.store.max_bytes or not hit.keys:
            return 0
        local = hit.namespace == "local"
        need = [f or (local and bool(w)) for f, w in zip(self.full, self.windows, strict=True)]
        if any(n and s is None for n, s in zip(need, spans, strict=True)):
            return 0
        b = self.store.block
        used = [s for n, s in zip(need, spans, strict=True) if n and s is not None]
        held = held_bytes([a for s in used for a in (s.keys, s.values)])
        per_block = sum((s.keys[:, :1].nbytes + s.values[:, :1].nbytes) * b for s in used)
        new = (len(hit.keys) - len(hit.blocks)) * per_block
        owner: Owner | None = None
        tenant = getattr(hit.keys, "tenant", None)
        if held <= self.store.request_cap and new >= VIEW_SHARE * held:
            owner = Owner(held, own_copy)

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
                pair = (span.keys[:, lo : lo + b], span.values[:, lo : lo + b])
                if owner is None:  # copies: a view would keep the whole array alive
                    pair = (pair[0].copy(), pair[1].copy())
                size += pair[0].nbytes + pair[1].nbytes
                layers.append(pair)
            blk = Block(tuple(layers), size, owner)
            if self.disk is not None:
                self.disk.put(hit.keys[i], blk, tenant)  # written later, on the tier's thread
            return blk

        return self.store.add(hit.keys, make)

    def record(self, hit: Hit, caches: list[Any]) -> None:
        """Before a local prefill that will be stored: its sliding layers'
        caches (still empty) become `Recording`s."""
        if not hit.keys or not self.store.max_bytes:
            return
        for layer, cache in enumerate(caches):
            if type(cache) is RotatingKVCache and cache.keys is None:
                caches[layer] = Recording(cache.max_size, cache.keep)
                caches[layer].start = hit.tokens

    # -- mlx work, on the mlx thread ---------------------------------------------

    def seed(self, hit: Hit, caches: list[Any]) -> None:
        """Fill every cache with the hit's prefix, as if mlx had prefilled it
        in one chunk: a sliding layer with the window before its end."""
        from disagg_agents.decode.kvcaches import fill_layer

        for layer, cache in enumerate(caches):
            keys, values = self.prefix_layer(hit, layer)
            kind = Kind.FULL if self.full[layer] else Kind.SLIDING
            fill_layer(cache, LayerKV(layer, kind, self.dtype, keys, values), hit.tokens)

    def recorded(self, caches: list[Any]) -> list[Span | None]:
        """Right after a local prefill, before any decode step: what each
        `Recording` sliding layer recorded, as a Span over one array made for the
        save; the layer turns plain. None for every other layer."""
        out: list[Span | None] = []
        for layer, cache in enumerate(caches):
            if not isinstance(cache, Recording):
                out.append(None)
                continue
            ks, vs = [k for k, _ in cache.recorded], [v for _, v in cache.recorded]
            caches[layer] = cache.plain()
            if not ks:
                out.append(None)
                continue
            keys, values = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
            mx.eval(keys, values)
            out.append(Span(as_numpy(keys)[0], as_numpy(values)[0], cache.start))
        return out

    def full_views(self, caches: list[Any], prompt_len: int) -> list[Span | None]:
        """Spans over the prompt's K/V in the full-attention layers of `caches`,
        views of mlx's arrays (no copy). Only for caches nothing writes any more
        (released by the decode loop, or never decoded)."""
        out: list[Span | None] = []
        for layer, cache in enumerate(caches):
            full = self.full[layer] and isinstance(cache, KVCache)
            if not full or cache.keys is None or cache.offset < prompt_len:
                out.append(None)
                continue
            mx.eval(cache.keys, cache.values)
            keys, values = as_numpy(cache.keys), as_numpy(cache.values)
            out.append(Span(keys[0, :, :prompt_len], values[0, :, :prompt_len]))
        return out


def own_copy(block: Block) -> Block:
    """A view block's K/V copied into memory of its own (Owner.copy)."""
    layers = tuple(None if p is None else (p[0].copy(), p[1].copy()) for p in block.layers)
    return Block(layers, block.nbytes)


def as_numpy(a: mx.array) -> np.ndarray:
    """An evaluated mx array as numpy in the wire dtype (bf16 as raw 16-bit
    words), sharing its memory: valid while the array is not written."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.asarray(a)

"""The prefill agent's prefix cache: torch K/V of block-aligned prompt prefixes,
so a prompt that starts with one computes only the rest.

Sliding-window layers keep just the last window-1 positions of what they saw,
so the window at an arbitrary cached prefix's end is not in any one request's
cache: blocks keep every position of every layer (a sliding layer's are
recorded as the forward computes them, see `_record`), and a hit seeds a
sliding layer with the window-1 positions before its end and the length it
stands for. Computing the suffix over cached keys gives the same tokens as the
full forward on CPU float32 (tests/test_prefix.py checks every architecture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from disagg_agents.prefill.pendingsaves import PendingSaves
from disagg_agents.prefix.store import Block, BlockStore, block_keys


class PrefillPrefixCache:
    """`kinds`: the model's layer kinds; `namespace`: what computed the K/V."""

    def __init__(self, max_bytes: int, kinds: list[list[Any]], namespace: str) -> None:
        self.store = BlockStore(max_bytes)
        self.namespace = namespace
        # A finished prompt's blocks, copied in after its K/V went out, or by the
        # next lookup if that comes first: it never waits on a peer's socket.
        self.pending = PendingSaves()

    @property
    def enabled(self) -> bool:  # the budget is a live setting: 0 turns the cache off
        return bool(self.store.max_bytes)

    def seed(self, dyn: Any, ids: list[int], salt: str | None = None) -> tuple[list[bytes], int]:
        """Fill the DynamicCache `dyn` with the longest cached prefix of `ids`
        (never the last token: its logits are the answer). Returns the prompt's
        block keys and the cached token count."""
        if not self.enabled:
            return [], 0
        b = self.store.block
        keys = block_keys(ids, self.namespace, b, salt)
        self.pending.flush()
        blocks = self.store.longest(keys, (len(ids) - 1) // b)
        n = len(blocks) * b
        self.store.record(len(ids), n)
        if n:
            for layer in range(len(blocks[0].layers)):
                parts = [blk.layers[layer] for blk in blocks]
                k = torch.cat([p[0] for p in parts if p is not None], dim=2)  # [1, H, n, D]
                v = torch.cat([p[1] for p in parts if p is not None], dim=2)
                # -- sliding window (prefixmem): only what the layer keeps at n --
                window = _window(dyn, layer)
                if window:
                    k, v = k[:, :, -(window - 1) :], v[:, :, -(window - 1) :]
                dyn.update(k, v, layer)
                if window:
                    dyn.layers[layer].cumulative_length = n  # positions and mask from n
        _record(dyn, n)
        return keys, n

    def saver(self, keys: list[bytes], dyn: Any) -> Callable[[], None]:
        """What keeps the blocks of a prompt just computed into `dyn`: to run
        once its K/V and logits are sent (the next seed() runs it if first)."""
        if not self.enabled or not keys:
            return lambda: None
        return self.pending.add(lambda: self.save(keys, dyn))

    def expected_hit(self, ids: list[int], salt: str | None = None) -> int:
        """Tokens seed() would take from the cache now (the queue's cost guess;
        counts no hit)."""
        if not self.enabled:
            return 0
        b = self.store.block
        keys = block_keys(ids, self.namespace, b, salt)
        return len(self.store.longest(keys, (len(ids) - 1) // b)) * b

    def save(self, keys: list[bytes], dyn: Any) -> None:
        """Keep the blocks of a prompt just computed into `dyn`."""
        if not self.enabled or not keys:
            return
        b = self.store.block
        # Per layer: [1, H, S, D] keys and values and the position of the first.
        spans: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for layer in dyn.layers:
            rec = getattr(layer, "disagg_recorded", None)
            if rec is None:
                spans.append((layer.keys, layer.values, 0))
            elif rec[0]:
                spans.append((torch.cat(rec[0], dim=2), torch.cat(rec[1], dim=2), rec[2]))
            else:
                return  # a sliding layer computed nothing: cannot store

        def make(i: int) -> Block | None:
            layers = []
            for k, v, start in spans:
                lo = i * b - start
                if lo < 0 or lo + b > k.shape[2]:
                    return None  # not held (its cached block went meanwhile)
                layers.append((k[:, :, lo : lo + b].clone(), v[:, :, lo : lo + b].clone()))
            size = sum(k.nbytes + v.nbytes for k, v in layers)
            return Block(tuple(layers), size)

        self.store.add(keys, make)


# -- sliding window (prefixmem) -------------------------------------------------


def _window(dyn: Any, layer: int) -> int:
    """A sliding layer's window (0: full attention)."""
    cached = dyn.layers[layer] if layer < len(dyn.layers) else None
    return int(getattr(cached, "sliding_window", 0) or 0) if cached is not None else 0


def _record(dyn: Any, start: int) -> None:
    """Make each sliding layer of `dyn` also keep every position the forward
    gives it from `start` on (the tensors it computed, not copies), for the
    store: the layer itself keeps only its window."""
    for cached in dyn.layers:
        if getattr(cached, "is_sliding", False):
            cached.disagg_recorded = ([], [], start)
            cached.update = _recording(cached.update, cached.disagg_recorded)


def _recording(
    update: Callable[..., Any], rec: tuple[list[torch.Tensor], list[torch.Tensor], int]
) -> Callable[..., Any]:
    def run(k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> Any:
        rec[0].append(k)
        rec[1].append(v)
        return update(k, v, *args, **kw)

    return run

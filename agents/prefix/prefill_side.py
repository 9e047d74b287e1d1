"""The prefill agent's prefix cache: torch K/V of block-aligned prompt prefixes,
so a prompt that starts with one computes only the rest.

Used only when every layer is full attention: a sliding-window layer keeps just
the last window-1 positions of what it saw, so the window at a cached prefix's
end is not there to seed; such models compute the whole prompt (and still send
only what the decode side lacks). Computing the suffix over cached keys gives
the same bits as the full forward on CPU float32 (tests/test_prefix.py checks
the tokens for every architecture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .pending import PendingStores
from .store import Block, PrefixCache, block_keys


class PrefillPrefix:
    """`kinds`: the model's layer kinds; `namespace`: what computed the K/V."""

    def __init__(self, max_bytes: int, kinds: list[list[Any]], namespace: str) -> None:
        self.cache = PrefixCache(max_bytes)
        self.enabled = bool(self.cache.max_bytes) and all(k[0] == "full" for k in kinds)
        self.namespace = namespace
        # A finished prompt's blocks, copied in after its K/V went out, or by the
        # next lookup if that comes first: it never waits on a peer's socket.
        self.pending = PendingStores()

    def seed(self, dyn: Any, ids: list[int], salt: str | None = None) -> tuple[list[bytes], int]:
        """Fill the DynamicCache `dyn` with the longest cached prefix of `ids`
        (never the last token: its logits are the answer). Returns the prompt's
        block keys and the cached token count."""
        if not self.enabled:
            return [], 0
        b = self.cache.block
        keys = block_keys(ids, self.namespace, b, salt)
        self.pending.flush()
        blocks = self.cache.longest(keys, (len(ids) - 1) // b)
        n = len(blocks) * b
        self.cache.record(len(ids), n)
        if n:
            for layer in range(len(blocks[0].layers)):
                parts = [blk.layers[layer] for blk in blocks]
                k = torch.cat([p[0] for p in parts if p is not None], dim=2)  # [1, H, n, D]
                v = torch.cat([p[1] for p in parts if p is not None], dim=2)
                dyn.update(k, v, layer)
        return keys, n

    def storer(self, keys: list[bytes], dyn: Any) -> Callable[[], None]:
        """What keeps the blocks of a prompt just computed into `dyn`: to run
        once its K/V and logits are sent (the next seed() runs it if first)."""
        if not self.enabled or not keys:
            return lambda: None
        return self.pending.add(lambda: self.store(keys, dyn))

    def expected_hit(self, ids: list[int], salt: str | None = None) -> int:
        """Tokens seed() would take from the cache now (the queue's cost guess;
        counts no hit)."""
        if not self.enabled:
            return 0
        b = self.cache.block
        keys = block_keys(ids, self.namespace, b, salt)
        return len(self.cache.longest(keys, (len(ids) - 1) // b)) * b

    def store(self, keys: list[bytes], dyn: Any) -> None:
        """Keep the blocks of a prompt just computed into `dyn`."""
        if not self.enabled or not keys:
            return
        b = self.cache.block

        def make(i: int) -> Block:
            layers = tuple(
                (
                    layer.keys[:, :, i * b : (i + 1) * b].clone(),
                    layer.values[:, :, i * b : (i + 1) * b].clone(),
                )
                for layer in dyn.layers
            )
            size = sum(k.nbytes + v.nbytes for k, v in layers)
            return Block(layers, size)

        self.cache.add(keys, make)

"""Prefix cache: a prompt's K/V kept in blocks of tokens, found by chained block
hashes and evicted least recently used by bytes.

Block i's key hashes block i-1's key with its own tokens, so one walk over a
prompt's keys finds the longest cached prefix in O(prompt). Framework-free: the
decode agent keeps numpy blocks (agents.prefix.decode_side), the prefill agent torch ones
(agents.prefix.prefill_side). A block is immutable once stored, so a request holding
one is never hurt when it is evicted.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_TOKENS = 16  # tokens per block: hits are multiples of this


def default_max_mb() -> int:
    """min(2 GiB, 10 % of this machine's memory)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return int(min(2048, ram / 10 / (1 << 20)))


def block_keys(
    ids: Sequence[int], namespace: str, block: int = BLOCK_TOKENS, salt: str | None = None
) -> list[bytes]:
    """One chained key per whole block of `ids`; `namespace` keeps K/V that was
    computed differently (another framework, device or dtype) apart, `salt`
    one tenant's prompts from another's (mixed into the first key, so every
    later key differs too): a probe with another salt never hits."""
    arr = np.asarray(ids, dtype="<i8")
    seed = namespace.encode() if salt is None else namespace.encode() + b"\0salt\0" + salt.encode()
    h = hashlib.blake2b(seed, digest_size=16).digest()
    out: list[bytes] = []
    for i in range(len(ids) // block):
        h = hashlib.blake2b(h + arr[i * block : (i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def prefix_digest(ids: Sequence[int]) -> str:
    """What PREFILL's `prefix_digest` carries for its first `start` tokens."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class Block:
    """One block's K/V: per layer (keys, values), None for a layer not kept
    (sliding-window layers)."""

    layers: tuple[tuple[Any, Any] | None, ...]
    nbytes: int


@dataclass(frozen=True)
class Prefix:
    """What a decode agent asks a prefill agent for: the K/V of positions from
    `start` on, since it holds the first `start` itself."""

    start: int
    digest: str  # prefix_digest(ids[:start])
    # Prepends the held positions to a full-attention layer's suffix K/V.
    extend: Callable[[Any], Any]


class PrefixCache:
    """Blocks by chained key, LRU by bytes; thread-safe. The budget holds at every
    moment, concurrent adds included: a block goes in only after older ones made
    room. One add stores at most 1/`share` of the budget (at least one block), so
    one long prompt cannot flush what every other request shares."""

    def __init__(self, max_bytes: int, block: int = BLOCK_TOKENS, share: int = 4) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.block = block
        self.request_cap = self.max_bytes // max(1, share)
        self.lock = threading.Lock()
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evictions = 0
        self.capped = 0  # adds stopped by the per-request cap

    def _touch(self, keys: Sequence[bytes]) -> None:
        # Deepest first, the first block last: the least recently used end then
        # holds leaves, so eviction never strands a chain's tail behind a gap.
        for k in reversed(keys):
            if k in self.blocks:
                self.blocks.move_to_end(k)

    def longest(self, keys: Sequence[bytes], max_blocks: int) -> list[Block]:
        """The cached blocks that start the prompt, at most `max_blocks`."""
        found: list[Block] = []
        with self.lock:
            for k in keys[: max(0, max_blocks)]:
                b = self.blocks.get(k)
                if b is None:
                    break
                found.append(b)
            self._touch(keys[: len(found)])
        return found

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one lookup (a hit when any token came from the cache)."""
        with self.lock:
            self.queries += 1
            self.query_tokens += prompt_tokens
            if cached_tokens:
                self.hits += 1
                self.hit_tokens += cached_tokens

    def _make_room(self, nbytes: int, ours: set[bytes]) -> bool:
        """Evict least recently used blocks until `nbytes` more fit (under the
        lock). False, evicting nothing more, when the next victim is one of the
        adding prompt's own blocks: its tail would strand behind the gap."""
        while self.bytes + nbytes > self.max_bytes and self.blocks:
            key = next(iter(self.blocks))
            if key in ours:
                return False
            old = self.blocks.pop(key)
            self.bytes -= old.nbytes
            self.evictions += 1
        return self.bytes + nbytes <= self.max_bytes

    def add(self, keys: Sequence[bytes], make: Callable[[int], Block | None]) -> int:
        """Store block i (made by `make(i)`; None: it cannot be made) for each key
        not cached yet, in order, until one cannot be stored: a later block could
        only be found through it. Returns the bytes added."""
        added = 0
        ours: set[bytes] = set()
        with self.lock:
            self._touch(keys)  # the prompt's cached blocks are not the ones to evict
        for i, k in enumerate(keys):
            with self.lock:
                if k in self.blocks:
                    ours.add(k)
                    continue
            b = make(i)  # outside the lock: it copies
            if b is None or b.nbytes > self.max_bytes:
                break
            if added and added + b.nbytes > self.request_cap:
                with self.lock:
                    self.capped += 1
                break
            with self.lock:
                if k not in self.blocks:
                    if not self._make_room(b.nbytes, ours):
                        break
                    self.blocks[k] = b
                    self.bytes += b.nbytes
                    added += b.nbytes
                ours.add(k)
        with self.lock:
            self._touch(keys)
        return added

    def clear(self) -> None:
        with self.lock:
            self.blocks.clear()
            self.bytes = 0

    def snapshot(self) -> dict[str, Any]:
        """For /status."""
        with self.lock:
            return {
                "max_bytes": self.max_bytes,
                "bytes": self.bytes,
                "blocks": len(self.blocks),
                "block_tokens": self.block,
                "queries": self.queries,
                "hits": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else None,
                "cached_tokens": self.hit_tokens,
                "token_hit_rate": self.hit_tokens / self.query_tokens
                if self.query_tokens
                else None,
                "evictions": self.evictions,
                "request_cap_bytes": self.request_cap,
                "capped_adds": self.capped,
            }

    def prometheus(self, role: str) -> str:
        s = self.snapshot()
        p, lab = "disagg_prefix_cache", f'{{role="{role}"}}'
        rows = [
            ("queries_total", "counter", s["queries"]),
            ("hits_total", "counter", s["hits"]),
            ("cached_tokens_total", "counter", s["cached_tokens"]),
            ("evictions_total", "counter", s["evictions"]),
            ("bytes", "gauge", s["bytes"]),
            ("max_bytes", "gauge", s["max_bytes"]),
        ]
        lines: list[str] = []
        for name, kind, value in rows:
            lines += [f"# TYPE {p}_{name} {kind}", f"{p}_{name}{lab} {value}"]
        return "\n".join(lines) + "\n"

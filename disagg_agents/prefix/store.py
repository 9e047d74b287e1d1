"""The block store: a prompt's K/V kept in blocks of tokens, found by chained
block hashes and evicted least recently used by bytes (its memory tier; the disk
tier is disagg_agents.prefix.disk). Each role's prefix cache keeps its blocks here.

Block i's key hashes block i-1's key with its own tokens, so one walk over a
prompt's keys finds the longest cached prefix in O(prompt). Framework-free: the
decode agent keeps numpy blocks (disagg_agents.decode.prefixcache), the prefill agent torch ones
(disagg_agents.prefill.prefixcache). A block is immutable once stored, so a request holding
one is never hurt when it is evicted.

Blocks may be views of memory they share with other blocks (an `Owner`: the
decode agent's blocks are views of a finished request's cache buffers, taken
without a copy). The budget counts the bytes really held: an owner's whole
memory while any of its blocks is cached. Evicting one such block frees
nothing, so once an owner's cached blocks are less than half of what it holds,
they are copied out (`Owner.copy`) and the owner's memory goes.
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
# Of the budget, what one tenant's blocks may hold while another's are cached too:
# one tenant's stream of long prompts evicted another's prefix (a tenant alone
# may use it all).
TENANT_SHARE = 0.5


class ChainKeys(list[bytes]):
    """A prompt's block keys, and the tenant (its cache salt) they belong to."""

    tenant: str | None = None


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
    out = ChainKeys()
    out.tenant = salt
    for i in range(len(ids) // block):
        h = hashlib.blake2b(h + arr[i * block : (i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def prefix_digest(ids: Sequence[int]) -> str:
    """What PREFILL's `prefix_digest` carries for its first `start` tokens."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


class Owner:
    """Memory that blocks are views of, charged once and whole while any of them
    is cached. `copy` gives a block the same K/V in memory of its own."""

    def __init__(self, nbytes: int, copy: Callable[[Block], Block]) -> None:
        self.nbytes = nbytes
        self.copy = copy
        self.keys: set[bytes] = set()  # its blocks in the cache
        self.live_bytes = 0  # their own bytes


@dataclass(frozen=True)
class Block:
    """One block's K/V: per layer (keys, values), None for a layer not kept
    (sliding-window layers). `nbytes`: its own K/V; with an `owner`, views of
    the owner's memory (which the budget counts instead)."""

    layers: tuple[tuple[Any, Any] | None, ...]
    nbytes: int
    owner: Owner | None = None


@dataclass(frozen=True)
class Prefix:
    """What a decode agent asks a prefill agent for: the K/V of positions from
    `start` on, since it holds the first `start` itself."""

    start: int
    digest: str  # prefix_digest(ids[:start])
    # Prepends the held positions to a full-attention layer's suffix K/V.
    extend: Callable[[Any], Any]


class BlockStore:
    """Blocks by chained key, LRU by bytes held; thread-safe. The budget holds at
    every moment, concurrent adds included: a block goes in only after older ones
    made room. One add stores at most 1/`share` of the budget (at least one plain
    block; an owner's memory must fit), so one long prompt cannot flush what
    every other request shares."""

    def __init__(self, max_bytes: int, block: int = BLOCK_TOKENS, share: int = 4) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.block = block
        self.share = max(1, share)
        self.request_cap = self.max_bytes // self.share
        self.lock = threading.Lock()
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evictions = 0
        self.capped = 0  # adds stopped by the per-request cap
        self.owned = 0  # of `bytes`: owners' memory (blocks held as views)
        self.compactions = 0  # owners whose surviving blocks were copied out
        self.tenant_share = TENANT_SHARE
        self.tenant_of: dict[bytes, str] = {}  # a salted block's tenant
        self.tenant_bytes: dict[str, int] = {}  # its blocks' own bytes, per tenant

    def _charge(self, b: Block) -> int:
        """What adding `b` adds to `bytes`: an owner's memory with its first block."""
        if b.owner is None:
            return b.nbytes
        return 0 if b.owner.keys else b.owner.nbytes

    def _insert(self, key: bytes, b: Block, tenant: str | None = None) -> None:
        charge = self._charge(b)
        if tenant is not None:
            self.tenant_of[key] = tenant
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + b.nbytes
        self.blocks[key] = b
        self.bytes += charge
        if b.owner is not None:
            self.owned += charge
            b.owner.keys.add(key)
            b.owner.live_bytes += b.nbytes

    def _evict(self, key: bytes) -> None:
        old = self.blocks.pop(key)
        self.evictions += 1
        tenant = self.tenant_of.pop(key, None)
        if tenant is not None:
            left = self.tenant_bytes[tenant] - old.nbytes
            if left > 0:
                self.tenant_bytes[tenant] = left
            else:
                del self.tenant_bytes[tenant]
        owner = old.owner
        if owner is None:
            self.bytes -= old.nbytes
            return
        owner.keys.discard(key)
        owner.live_bytes -= old.nbytes
        if not owner.keys:
            self.bytes -= owner.nbytes
            self.owned -= owner.nbytes
        elif 2 * owner.live_bytes < owner.nbytes:
            self._compact(owner)

    def _compact(self, owner: Owner) -> None:
        """An owner's cached blocks become copies (same places in the LRU order),
        so its memory goes once no request holds it either. Under the lock: a
        copy of less than half of the owner, and rare."""
        for key in list(owner.keys):
            copied = owner.copy(self.blocks[key])
            self.blocks[key] = copied
            self.bytes += copied.nbytes
        self.bytes -= owner.nbytes
        self.owned -= owner.nbytes
        owner.keys.clear()
        owner.live_bytes = 0
        self.compactions += 1

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

    def set_budget(self, max_bytes: int) -> None:
        """A new budget, live: what no longer fits goes, least recently used first."""
        with self.lock:
            self.max_bytes = max(0, int(max_bytes))
            self.request_cap = self.max_bytes // self.share
            self._make_room(0, set())

    def _make_room(self, nbytes: int, ours: set[bytes]) -> bool:
        """Evict least recently used blocks until `nbytes` more fit (under the
        lock). False, evicting nothing more, when the next victim is one of the
        adding prompt's own blocks: its tail would strand behind the gap."""
        while self.bytes + nbytes > self.max_bytes and self.blocks:
            key = next(iter(self.blocks))
            if key in ours:
                return False
            self._evict(key)
        return self.bytes + nbytes <= self.max_bytes

    def _within_share(self, tenant: str | None, nbytes: int, ours: set[bytes]) -> bool:
        """Under the lock: room for `nbytes` more of `tenant`'s blocks within its
        share, made by evicting its own least recently used blocks (never another
        tenant's); no limit for unsalted blocks or a tenant alone in the cache."""
        if tenant is None or not set(self.tenant_bytes) - {tenant}:
            return True
        cap = int(self.max_bytes * self.tenant_share)
        while self.tenant_bytes.get(tenant, 0) + nbytes > cap:
            victim = next((k for k in self.blocks if self.tenant_of.get(k) == tenant), None)
            if victim is None or victim in ours:
                return False
            self._evict(victim)
        return True

    def add(self, keys: Sequence[bytes], make: Callable[[int], Block | None]) -> int:
        """Store block i (made by `make(i)`; None: it cannot be made) for each key
        not cached yet, in order, until one cannot be stored: a later block could
        only be found through it. Returns the bytes added. Keys from block_keys
        with a salt are that tenant's: within its share (TENANT_SHARE)."""
        tenant = getattr(keys, "tenant", None)
        added = 0
        ours: set[bytes] = set()
        owners: set[Owner] = set()
        with self.lock:
            self._touch(keys)  # the prompt's cached blocks are not the ones to evict
        for i, k in enumerate(keys):
            with self.lock:
                if k in self.blocks:
                    ours.add(k)
                    continue
            b = make(i)  # outside the lock: it may copy
            if b is None:
                break
            with self.lock:
                charge = self._charge(b)
                if charge > self.max_bytes:
                    break
                if (added or b.owner is not None) and added + charge > self.request_cap:
                    self.capped += 1
                    break
                if k not in self.blocks:
                    if not self._within_share(tenant, b.nbytes, ours):
                        break
                    if not self._make_room(charge, ours):
                        break
                    charge = self._charge(b)  # making room may have compacted its owner
                    if self.bytes + charge > self.max_bytes:
                        break
                    self._insert(k, b, tenant)
                    added += charge
                    if b.owner is not None:
                        owners.add(b.owner)
                ours.add(k)
        with self.lock:
            for owner in owners:  # most of its blocks were cached already (another add)
                if owner.keys and 2 * owner.live_bytes < owner.nbytes:
                    self._compact(owner)
            self._touch(keys)
        return added

    def clear(self) -> None:
        with self.lock:
            for b in self.blocks.values():
                if b.owner is not None:
                    b.owner.keys.clear()
                    b.owner.live_bytes = 0
            self.blocks.clear()
            self.tenant_of.clear()
            self.tenant_bytes.clear()
            self.bytes = self.owned = 0

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
                # of `bytes`: memory held whole by blocks that are views of it
                "owned_bytes": self.owned,
                "compactions": self.compactions,
            }

    def prometheus(self, role: str) -> str:
        s = self.snapshot()
        return prom_series(
            "disagg_prefix_cache",
            role,
            [
                ("queries_total", "counter", s["queries"]),
                ("hits_total", "counter", s["hits"]),
                ("cached_tokens_total", "counter", s["cached_tokens"]),
                ("evictions_total", "counter", s["evictions"]),
                ("bytes", "gauge", s["bytes"]),
                ("max_bytes", "gauge", s["max_bytes"]),
            ],
        )


def prom_series(prefix: str, role: str, rows: list[tuple[str, str, Any]]) -> str:
    """Prometheus text for (name, counter|gauge, value) rows, each labelled by role."""
    lab = f'{{role="{role}"}}'
    lines: list[str] = []
    for name, kind, value in rows:
        lines += [f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name}{lab} {value}"]
    return "\n".join(lines) + "\n"

"""The decode agent's prefix save takes a prompt's K/V from the request's own
caches without a copy (disagg_agents/decode/prefixsave.py):

- in process, on the real decode loop and a tiny model: the stored blocks are
  views inside the cache buffers the loop released (a lone request at its end,
  a request that joined a batch, a lone request whose prefix another lookup
  wanted while it still decoded), the budget counts those buffers whole, and
  every greedy token is mlx-lm's own;
- the bookkeeping of blocks that share memory: charged once, whole; the
  survivors of a partial eviction copied out;
- real agents: hits after zero-copy saves give the tokens of cache-off runs
  and of mlx-lm's generate, and a second request hits while the first decodes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from disagg.serving.localagents import AgentProc
from disagg_agents.decode.engine import DecodeEngine
from disagg_agents.decode.loop import DecodeLoop, Seq
from disagg_agents.decode.prefixcache import DecodePrefixCache, Hit, as_numpy
from disagg_agents.decode.prefixsave import PendingSave
from disagg_agents.prefix.store import Block, BlockStore, Owner, block_keys
from tests.agenthelpers import cache_status
from tests.conftest import PairFactory, ask
from tests.references import mlx_greedy
from tests.tinymodels import PROMPT, shared_tiny

N_NEW = 16
LONG = 500  # the first request's tokens, decoding while a second one hits
NS = "local"


def words(n: int, tag: str = "") -> str:
    base = PROMPT.split()
    return tag + " ".join(base[i % len(base)] for i in range(n))


# -- in process: the decode loop, a tiny model ------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., Path], refs: Any) -> DecodeEngine:
    engine: DecodeEngine = refs.decode_engine(shared_tiny("llama"))
    return engine


@pytest.fixture(scope="module")
def loop(engine: DecodeEngine) -> DecodeLoop:
    return DecodeLoop(engine.model)


def new_prefix(engine: DecodeEngine, mb: float = 64) -> DecodePrefixCache:
    return DecodePrefixCache(int(mb * (1 << 20)), engine.fingerprint["layers"], engine.dtype)


def ids_of(engine: DecodeEngine, text: str) -> list[int]:
    return [int(i) for i in engine.tokenizer.encode(text)]


class Request:
    """One request on the loop, as the decode agent runs it: a local prefill
    (seeded from a hit), the first token, then the loop; its save pending."""

    def __init__(
        self,
        engine: DecodeEngine,
        loop: DecodeLoop,
        prefix: DecodePrefixCache,
        ids: list[int],
        n: int,
    ) -> None:
        self.ids = ids
        model = engine.model
        self.hit = prefix.lookup(NS, ids, local=True)
        caches = make_prompt_cache(model)
        if self.hit.tokens:
            loop.call(prefix.seed, self.hit, caches)

        def prefill() -> int:
            if self.hit.tokens < len(ids) - 1:  # as generate_step: all but the last, then it
                model(mx.array(ids[self.hit.tokens : -1])[None], cache=caches)
            logits = model(mx.array(ids[-1:])[None], cache=caches)[:, -1, :]
            return int(np.array(mx.argmax(logits, axis=-1))[0])

        first = loop.call(prefill)
        self.caches = list(caches)  # the save empties the list it is handed
        self.tokens = [first]
        self.save = PendingSave(prefix, loop, self.hit, len(ids), [None] * len(caches))
        self.seq = Seq(caches, first, None, n, frozenset())
        self.save.attach(self.seq)
        loop.join(self.seq)

    def read(self, count: int | None = None) -> None:
        """Take tokens off the queue (all when `count` is None), polling the save
        between them as the agent does between bursts."""
        while count is None or count > 0:
            item = self.seq.out.get(timeout=120)
            if item is None:
                self.save.finish()
                return
            assert not isinstance(item, Exception), item
            self.tokens.append(item[0])
            self.save.poll()
            if count is not None:
                count -= 1


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def buffers(caches: list[Any]) -> list[tuple[int, int]]:
    """[start, end) addresses of every layer's keys and values buffer."""
    out: list[tuple[int, int]] = []
    for c in caches:
        for a in (c.keys, c.values):
            v = as_numpy(a)
            start = v.__array_interface__["data"][0]
            out.append((start, start + v.nbytes))
    return out


def held(caches: list[Any]) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in caches)


def assert_views_of(blocks: list[Block], caches: list[Any]) -> None:
    """Every array of every block lies inside the buffer of its layer's cache."""
    spans = buffers(caches)
    assert blocks
    for blk in blocks:
        assert blk.owner is not None
        for layer, pair in enumerate(blk.layers):
            assert pair is not None
            for j, a in enumerate(pair):
                lo, hi = spans[2 * layer + j]
                at = a.__array_interface__["data"][0]
                assert not a.flags.owndata and lo <= at and at + a.nbytes <= hi


def test_a_lone_request_stores_views_of_its_own_caches_at_its_end(
    engine: DecodeEngine, loop: DecodeLoop
) -> None:
    prefix = new_prefix(engine)
    ids = ids_of(engine, words(140, "Lone: "))
    req = Request(engine, loop, prefix, ids, N_NEW)
    req.read()
    assert req.tokens == mlx_greedy(engine.model, ids, N_NEW)
    released = req.caches
    blocks = prefix.store.longest(req.hit.keys, len(req.hit.keys))
    assert len(blocks) == len(ids) // 16
    assert_views_of(blocks, released)
    # The budget counts the buffers whole: prompt, decoded tokens and headroom.
    snap = prefix.store.snapshot()
    assert snap["bytes"] == snap["owned_bytes"] == held(released)
    assert held(released) > sum(b.nbytes for b in blocks)
    # A hit on it: the prefix seeded from those views, mlx-lm's tokens.
    other = ids_of(engine, words(140, "Lone: ") + " and then it rained")
    hit = Request(engine, loop, prefix, other, N_NEW)
    hit.read()
    assert hit.hit.tokens == common(ids, other) // 16 * 16 > 0
    assert hit.tokens == mlx_greedy(engine.model, other, N_NEW)


def test_a_request_that_joins_a_batch_stores_its_caches_as_the_batch_takes_them(
    engine: DecodeEngine, loop: DecodeLoop
) -> None:
    prefix = new_prefix(engine)
    a_ids = ids_of(engine, words(140, "First: "))
    b_ids = ids_of(engine, words(130, "Second: "))
    a = Request(engine, loop, prefix, a_ids, 400)
    a.read(3)  # decoding alone, on its plain caches: nothing stored yet
    assert not a.save.done and prefix.store.snapshot()["blocks"] == 0
    b = Request(engine, loop, prefix, b_ids, 400)
    b.read(3)
    a.read(3)
    # b's join merged both into the batch: both stored from what was released.
    assert a.save.done and b.save.done
    for r in (a, b):
        blocks = prefix.store.longest(r.hit.keys, len(r.hit.keys))
        assert len(blocks) == len(r.ids) // 16
        assert_views_of(blocks, r.caches)
    a.read()
    b.read()
    assert a.tokens == mlx_greedy(engine.model, a_ids, 400)
    assert b.tokens == mlx_greedy(engine.model, b_ids, 400)


def test_a_lookup_takes_the_prefix_of_a_request_still_decoding_alone(
    engine: DecodeEngine, loop: DecodeLoop
) -> None:
    prefix = new_prefix(engine)
    shared = words(130, "Rubric: ")
    a_ids = ids_of(engine, shared + " answer one")
    a = Request(engine, loop, prefix, a_ids, 600)
    a.read(4)
    assert not a.save.done
    b_ids = ids_of(engine, shared + " answer two is here")
    hit = prefix.lookup(NS, b_ids, local=True)
    # The save ran now: the loop goes on with copies, the save keeps a's own.
    assert a.save.done and hit.tokens > 0
    assert_views_of(hit.blocks, a.caches)
    assert hit.tokens == common(a_ids, b_ids) // 16 * 16
    a.read()
    assert a.tokens == mlx_greedy(engine.model, a_ids, 600)


# -- blocks that share memory -----------------------------------------------------


def view_blocks(n: int, block: int) -> tuple[np.ndarray, list[Block]]:
    """n blocks of `block` float32 each, views of one buffer twice their size."""
    buf = np.arange(2 * n * block, dtype=np.float32)

    def copy(b: Block) -> Block:
        return Block(tuple(None if p is None else (p[0].copy(), p[1]) for p in b.layers), b.nbytes)

    owner = Owner(buf.nbytes, copy)
    out = [Block(((buf[i * block : (i + 1) * block], None),), block * 4, owner) for i in range(n)]
    return buf, out


class SlowSaveLoop:
    """A decode loop stand-in whose `call` parks the first save's mlx step until
    let go: the window in which the request's own thread may fail."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.inside.set()
        assert self.go.wait(10)
        return fn(*args)


class RecordingPrefix:
    """The prefix cache's two calls a save makes, recorded."""

    def __init__(self) -> None:
        self.saved: list[list[Any]] = []
        self.removed = 0

    def full_views(self, caches: list[Any], prompt_len: int) -> list[Any]:
        return ["view"] * len(caches)

    def save(self, hit: Any, spans: list[Any]) -> None:
        self.saved.append(spans)

    def pending_remove(self, save: Any) -> None:
        self.removed += 1


def test_a_request_failing_while_a_lookup_saves_its_prefix_waits_for_that_save(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lookup takes a request's save (`take_now`) while the request's own thread
    fails and drops it: the drop waits for the save, which finishes whole (a
    shuffled CI run saw the drop empty the recorded layers mid-save: "zip()
    argument 2 is longer than argument 1" as the agent's last error)."""
    loop, prefix = SlowSaveLoop(), RecordingPrefix()
    hit = Hit(NS, [b"k"], [], 4)
    save = PendingSave(prefix, loop, hit, 8, [None, None])  # type: ignore[arg-type]
    # The save the request made: attached, its caches released by the loop.
    save.seq = object()  # type: ignore[assignment]
    save.released.set_result(["layer0", "layer1"])
    lookup = threading.Thread(target=save.take_now)
    lookup.start()
    assert loop.inside.wait(10)  # the lookup is mid-save, the lock held
    failed = threading.Thread(target=save.drop)  # the request's thread, failing
    failed.start()
    failed.join(0.3)
    assert failed.is_alive(), "the drop did not wait for the save in progress"
    loop.go.set()
    lookup.join(10)
    failed.join(10)
    assert "saving a prompt's prefix blocks failed" not in caplog.text, caplog.text
    assert prefix.saved == [["view", "view"]]
    assert save.done and save.sliding == []


def test_shared_memory_is_charged_once_whole_and_copied_out_when_mostly_evicted() -> None:
    buf, blocks = view_blocks(8, 16)  # 512 B of blocks in 1024 B of buffer
    cache = BlockStore(4000, block=4, share=1)
    keys = block_keys(list(range(32)), "n", 4)
    assert cache.add(keys, lambda i: blocks[i]) == buf.nbytes
    assert cache.bytes == cache.owned == buf.nbytes
    # Another add needs room: the LRU tail of the owner goes; once its cached
    # blocks are under half its buffer, they are copied out and it is let go.
    other = block_keys([9] * 4 * 30, "n", 4)
    cache.add(other, lambda i: Block((None,), 100))
    snap = cache.snapshot()
    assert snap["compactions"] == 1 and cache.owned == 0
    left = cache.longest(keys, 8)
    assert 0 < len(left) < 8
    for i, blk in enumerate(left):
        pair = blk.layers[0]
        assert pair is not None
        arr = pair[0]
        assert blk.owner is None and not np.shares_memory(arr, buf)
        assert np.array_equal(arr, np.arange(i * 16, (i + 1) * 16, dtype=np.float32))
    assert cache.bytes == 100 * (len(cache.blocks) - len(left)) + 64 * len(left)
    assert cache.bytes <= cache.max_bytes


def test_an_owner_over_the_per_request_cap_is_not_stored() -> None:
    buf, blocks = view_blocks(4, 16)
    cache = BlockStore(4 * buf.nbytes - 4, block=4)  # cap: a quarter, under the buffer
    assert cache.add(block_keys(list(range(16)), "n", 4), lambda i: blocks[i]) == 0
    assert cache.bytes == 0 and cache.capped == 1


def test_views_only_where_the_blocks_are_most_of_the_buffer(
    engine: DecodeEngine, loop: DecodeLoop
) -> None:
    """A hit's short suffix would keep the whole buffer for a few blocks: copied."""
    prefix = new_prefix(engine)
    shared = words(140, "Long rubric: ")
    first = Request(engine, loop, prefix, ids_of(engine, shared + " one"), 4)
    first.read()
    owned = prefix.store.owned
    assert owned > 0
    second = Request(engine, loop, prefix, ids_of(engine, shared + " two " + words(30)), 4)
    second.read()
    assert second.hit.tokens > 0
    new = prefix.store.longest(second.hit.keys, len(second.hit.keys))[len(second.hit.blocks) :]
    pairs = [b.layers[0] for b in new if b.owner is None]
    assert new and len(pairs) == len(new)
    assert all(p is not None and p[0].flags.owndata for p in pairs)
    assert prefix.store.owned == owned
    assert prefix.store.bytes == owned + sum(b.nbytes for b in new)


# -- real agents -------------------------------------------------------------------


def base(**kw: Any) -> dict[str, Any]:
    req = {"raw": True, "max_tokens": N_NEW, "ignore_eos": True, "return_prompt_ids": True}
    return {**req, **kw}


@pytest.fixture(scope="module")
def pair(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc, Path]:
    prefill, decode = agent_pair(shared_tiny("llama"))
    return prefill, decode, Path(json.loads(decode.control("/status"))["model"])


@pytest.mark.parametrize("placement", ["remote", "local"])
def test_hits_after_zero_copy_stores_match_cache_off_and_mlx(
    pair: tuple[AgentProc, AgentProc, Path], refs: Any, placement: str
) -> None:
    prefill, decode, model = pair
    target = {"prefill": {"host": prefill.host, "port": prefill.port}, "placement": placement}
    shared = words(140, f"Zero copy {placement}: ")
    second = shared + " then the cache said hello"
    off = ask(decode, base(prompt=second, prefix_cache=False, **target))
    s0 = cache_status(decode)
    first = ask(decode, base(prompt=shared + " the end", **target))
    s1 = cache_status(decode)
    # The storing miss kept views of its caches: the bytes held are its buffers,
    # more than the blocks' own K/V (the buffers have room for decoding too).
    stored = len(first.prompt_ids or []) // 16 * 16
    fp = json.loads(decode.control("/status"))["fingerprint"]
    per_token = len(fp["layers"]) * 2 * fp["num_kv_heads"] * fp["head_dim"] * 4
    assert s1["owned_bytes"] - s0["owned_bytes"] == s1["bytes"] - s0["bytes"]
    assert s1["bytes"] - s0["bytes"] > stored * per_token
    hit = ask(decode, base(prompt=second, **target))
    assert (hit.metrics.cached_tokens or 0) > 0
    assert hit.token_ids == off.token_ids
    ids = hit.prompt_ids or []
    assert hit.token_ids == mlx_greedy(refs.mlx_own(model), ids, N_NEW)


def test_a_second_request_hits_while_the_first_still_decodes(
    pair: tuple[AgentProc, AgentProc, Path],
) -> None:
    prefill, decode, _ = pair
    target = {"prefill": {"host": prefill.host, "port": prefill.port}, "placement": "remote"}
    shared = words(140, "While decoding: ")
    later = shared + " a later answer"
    off = ask(decode, base(prompt=later, prefix_cache=False, **target))
    started = threading.Event()
    box: dict[str, Any] = {}

    def on_token(_: dict[str, Any]) -> None:
        started.set()

    def long_one() -> None:
        # Long enough to outlast the hit below (checked: "res" not in box).
        req = base(prompt=shared + " the first answer", max_tokens=LONG, **target)
        box["res"] = ask(decode, req, on_token=on_token, timeout_s=600)

    t = threading.Thread(target=long_one)
    t.start()
    try:
        assert started.wait(120)
        hit = ask(decode, base(prompt=later, **target))
        assert "res" not in box  # the first was still decoding
    finally:
        t.join(600)
    assert (hit.metrics.cached_tokens or 0) > 0
    assert hit.token_ids == off.token_ids
    first_off = ask(
        decode,
        base(prompt=shared + " the first answer", max_tokens=LONG, prefix_cache=False, **target),
    )
    assert box["res"].token_ids == first_off.token_ids

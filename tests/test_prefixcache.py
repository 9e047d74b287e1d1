"""The prefix cache's bookkeeping, without models: chained keys, longest match,
LRU by bytes that evicts a chain's tail before its head."""

from __future__ import annotations

from disagg.cli.render_fleet import _prefix_cache
from disagg_agents.prefix.store import Block, BlockStore, block_keys, prefix_digest
from disagg_agents.wire.status import AgentStatus


def blk(nbytes: int = 100) -> Block:
    return Block((None,), nbytes)


def test_keys_chain_whole_blocks_and_namespaces_differ() -> None:
    ids = list(range(100))
    keys = block_keys(ids, "a", 32)
    assert len(keys) == 3
    assert block_keys(ids[:64] + [0] * 36, "a", 32)[:2] == keys[:2]
    assert block_keys([99] + ids[1:], "a", 32)[1] != keys[1]  # a key covers all before it
    assert block_keys(ids, "b", 32)[0] != keys[0]
    assert prefix_digest(ids[:64]) == prefix_digest(list(range(64)))


def test_longest_prefix_stops_at_the_first_gap_and_the_cap() -> None:
    cache = BlockStore(10_000, block=4, share=1)
    keys = block_keys(list(range(16)), "n", 4)
    cache.add(keys[:2], lambda i: blk())
    assert len(cache.longest(keys, 4)) == 2
    assert len(cache.longest(keys, 1)) == 1
    cache.add([keys[3]], lambda i: blk())  # unreachable without block 2
    assert len(cache.longest(keys, 4)) == 2


def test_lru_by_bytes_evicts_tails_first() -> None:
    cache = BlockStore(350, block=4, share=1)
    a = block_keys(list(range(12)), "n", 4)
    b = block_keys([7] * 12, "n", 4)
    cache.add(a, lambda i: blk())
    assert cache.bytes == 300
    cache.add(b[:1], lambda i: blk())  # over budget: a's tail goes, its head stays
    assert cache.bytes <= 350 and cache.evictions == 1
    assert len(cache.longest(a, 3)) == 2
    cache.add([b[0]], lambda i: blk(1000))  # cached already: nothing to do
    big = block_keys([5] * 4, "n", 4)
    cache.add(big, lambda i: blk(1000))  # larger than the budget: never stored
    assert cache.longest(big, 1) == []


def test_counters_status_and_prometheus() -> None:
    cache = BlockStore(1 << 20)
    cache.record(100, 0)
    cache.record(100, 64)
    snap = cache.snapshot()
    assert snap["queries"] == 2 and snap["hits"] == 1 and snap["hit_rate"] == 0.5
    text = cache.prometheus("decode")
    assert 'disagg_prefix_cache_hits_total{role="decode"} 1' in text
    assert 'disagg_prefix_cache_queries_total{role="decode"} 2' in text
    st = AgentStatus.from_json({"prefix_cache": snap})  # as `disagg status` reads it
    assert st.mistyped == () and "hit 50% of 2," in _prefix_cache(st)
    assert _prefix_cache(AgentStatus()) == "-"

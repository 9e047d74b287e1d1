"""The prefix cache under load, with real agents:

- its memory stays within `--prefix-cache-mb` at every moment, concurrent
  stores included, and one request adds at most a quarter of it;
- a remote prefill that dies mid-stream while the decode agent holds (and has
  used) a prefix hit falls back to a local prefill with mlx-lm's own tokens;
- gpt_oss (sliding-window layers) gets prefix hits on the local path and on the
  prefill agent, with the tokens of a run without the cache and of the
  monolithic frameworks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from disagg.serving.localagents import AgentProc
from disagg_agents.prefix.store import Block, BlockStore, block_keys
from tests.agenthelpers import cache_status
from tests.conftest import PairFactory, ask
from tests.references import hf_greedy, mlx_greedy
from tests.slowprefill import slow_prefill
from tests.tinymodels import PROMPT, shared_tiny

N_NEW = 16
WINDOW = 8
# A block of a tiny model: 4 layers x K, V x 2 heads x 16 tokens x dim 16 x fp32.
BLOCK_BYTES = 4 * 2 * 2 * 16 * 16 * 4


def base(**kw: Any) -> dict[str, Any]:
    req = {"raw": True, "max_tokens": N_NEW, "ignore_eos": True, "return_prompt_ids": True}
    return {**req, **kw}


def text(tag: str, times: int = 6) -> str:
    return f"{tag}: " + " ".join([PROMPT] * times)


# -- the store's budget, without models ------------------------------------------


def test_concurrent_adds_never_exceed_the_budget_and_one_add_is_capped() -> None:
    cache = BlockStore(40 * 100, block=4)  # 40 blocks of 100 bytes; a request adds <= 10
    seen: list[int] = []

    def make(i: int) -> Block:
        seen.append(cache.bytes)  # between two inserts of some add
        time.sleep(0.0005)  # adds interleave
        return Block((None,), 100)

    chains = [block_keys([t] * 100, "n", 4) for t in range(12)]  # 25 blocks each
    with ThreadPoolExecutor(6) as pool:
        added = list(pool.map(lambda keys: cache.add(keys, make), chains))
    assert max(seen) <= cache.max_bytes and cache.bytes <= cache.max_bytes
    assert all(0 < a <= 1000 for a in added), added  # each capped at a quarter
    assert cache.evictions > 0
    # Alone, a 25-block prompt stops at the cap (concurrent ones may stop earlier, at
    # a block of their own that became the oldest: CI saw all six do so under load).
    capped = cache.snapshot()["capped_adds"]
    assert cache.add(block_keys([99] * 100, "n", 4), make) == 1000
    assert cache.snapshot()["capped_adds"] == capped + 1
    # A prompt's own cached head is never evicted to make room for its tail.
    cache = BlockStore(300, block=4, share=1)
    keys = block_keys(list(range(40)), "n", 4)
    assert cache.add(keys, lambda i: Block((None,), 100)) == 300
    assert len(cache.longest(keys, 10)) == 3


# -- real agents ------------------------------------------------------------------


def test_decode_store_stays_in_budget_under_concurrent_requests(
    agent_pair: PairFactory,
) -> None:
    budget = 12 * BLOCK_BYTES
    _, decode = agent_pair(
        "llama", seed=3, decode_args=["--prefix-cache-mb", str(budget / (1 << 20))]
    )
    # The pooled agent's cache, emptied (a live budget of 0 evicts everything), then
    # given the test's budget back: what follows is this test's alone.
    decode.settings(prefix_cache_mb=0)
    decode.settings(prefix_cache_mb=budget / (1 << 20))
    s0 = cache_status(decode)
    assert s0["max_bytes"] == budget and s0["request_cap_bytes"] == budget // 4
    assert s0["bytes"] == 0
    # One long prompt (17 blocks) alone adds at most a quarter of the budget (3).
    one = ask(decode, base(prompt=text("Alone"), placement="local"))
    assert len(one.prompt_ids or []) >= 8 * 16
    s1 = cache_status(decode)
    assert 0 < s1["bytes"] <= budget // 4 and s1["capped_adds"] == s0["capped_adds"] + 1
    # Six at once, every one a different long prompt: the store, read all along,
    # never holds more than its budget.
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], cache_status(decode)["bytes"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            reqs = [base(prompt=text(f"Student {i}"), placement="local") for i in range(6)]
            results = list(pool.map(lambda r: ask(decode, r), reqs))
    finally:
        stop.set()
        watcher.join()
    s2 = cache_status(decode)
    assert all(len(r.token_ids) == N_NEW for r in results)
    assert peak[0] <= budget and s2["bytes"] <= budget
    assert s2["evictions"] > s1["evictions"]


LAYER_S = 0.8  # the killed prefill agent's delay per layer: its stream takes 2.4 s


@pytest.fixture
def slow_pair(fresh_agents: PairFactory) -> tuple[AgentProc, AgentProc, Path]:
    """A llama pair whose prefill agent takes LAYER_S per layer (4 layers): the test
    kills it."""
    prefill, decode = fresh_agents(shared_tiny("llama"), **slow_prefill(LAYER_S))
    return prefill, decode, Path(json.loads(decode.control("/status"))["model"])


def test_prefill_dying_mid_stream_after_a_prefix_hit_falls_back_to_mlx_tokens(
    slow_pair: tuple[AgentProc, AgentProc, Path], refs: Any
) -> None:
    prefill, decode, model = slow_pair
    target = {"prefill": {"host": prefill.host, "port": prefill.port}, "placement": "remote"}
    first = ask(decode, base(prompt=text("Rubric") + " Answer one.", **target))
    assert first.metrics.method == "disaggregated"
    hits0 = cache_status(decode)["hits"]
    out: dict[str, Any] = {}

    def second() -> None:
        out["res"] = ask(decode, base(prompt=text("Rubric") + " Answer two is longer.", **target))

    t = threading.Thread(target=second)
    t.start()
    # Kill the prefill agent once it streams this prompt's layers (LAYER_S apart).
    deadline = time.monotonic() + 60
    while json.loads(prefill.control("/status"))["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(LAYER_S / 2)
    prefill.proc.kill()
    t.join(120)
    res = out["res"]
    assert res.metrics.method == "local-fallback", res.metrics
    assert res.metrics.fallback_kind in ("stream", "timeout"), res.metrics
    # The decode agent held a hit on that prefill agent's K/V (the local lookup
    # that followed missed: nothing was prefilled here yet).
    assert cache_status(decode)["hits"] == hits0 + 1
    mlx = mlx_greedy(refs.mlx_own(model), res.prompt_ids or [], N_NEW)
    assert res.token_ids == mlx


@pytest.fixture(scope="module")
def gpt_oss(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc, Path]:
    prefill, decode = agent_pair(shared_tiny("gpt_oss"))  # sliding window WINDOW
    return prefill, decode, Path(json.loads(decode.control("/status"))["model"])


def shared_blocks(a: list[int], b: list[int], cap: int) -> int:
    """Prompt positions of `b` a cache holding `a` can serve: whole blocks of
    their common start, at most `cap`."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return min(n, cap) // 16 * 16


def check_hit(ask_one: Callable[[dict[str, Any]], Any], shared: str) -> tuple[Any, Any, int]:
    """Cache off, then a prompt sharing `shared`, then the first again: the hit
    has the cache-off tokens. Returns (off, hit, whole shared blocks)."""
    off = ask_one(base(prompt=shared + " Then the cache said hello.", prefix_cache=False))
    first = ask_one(base(prompt=shared + " The end."))
    hit = ask_one(base(prompt=shared + " Then the cache said hello."))
    assert hit.token_ids == off.token_ids
    ids = hit.prompt_ids or []
    return off, hit, shared_blocks(first.prompt_ids or [], ids, len(ids) - 1)


def test_gpt_oss_local_prefill_hits_and_matches(
    gpt_oss: tuple[AgentProc, AgentProc, Path], refs: Any
) -> None:
    _, decode, model = gpt_oss
    off, hit, n = check_hit(lambda r: ask(decode, {**r, "placement": "local"}), text("Local"))
    ids = hit.prompt_ids or []
    assert len(ids) >= 4 * WINDOW and n > 0
    assert off.metrics.cached_tokens == 0
    assert hit.metrics.cached_tokens == n  # every layer skipped the prefix
    assert hit.token_ids == mlx_greedy(refs.mlx_own(model), ids, N_NEW)


def test_gpt_oss_prefill_agent_hits_and_matches(
    gpt_oss: tuple[AgentProc, AgentProc, Path], refs: Any
) -> None:
    prefill, decode, model = gpt_oss
    target = {"prefill": {"host": prefill.host, "port": prefill.port}, "placement": "remote"}
    off, hit, n = check_hit(lambda r: ask(decode, {**r, **target}), text("Remote"))
    ids = hit.prompt_ids or []
    assert hit.metrics.method == off.metrics.method == "disaggregated"
    assert off.metrics.cached_tokens == off.metrics.prefill_cached_tokens == 0
    # The prefill agent computed only the suffix on every layer; the decode agent
    # asked only for what its sliding layers need (the last window at least).
    assert hit.metrics.prefill_cached_tokens == n > 0
    assert 0 < hit.metrics.cached_tokens <= len(ids) - WINDOW
    assert hit.token_ids == hf_greedy(refs.hf(model), ids, N_NEW)

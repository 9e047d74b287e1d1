"""Prefix-aware routing (disagg.serving.affinity): the affinity table and rule
without timing, placement discounting a prefix hit, and with real agents: a
3-turn chat keeps its decode agent (and its prefix cache) while that agent is
busier than the other one."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from disagg.serving import affinity
from disagg.serving.affinity import AffinityTable, choose, prefix_keys, slack
from disagg.serving.localagents import AgentProc
from disagg.serving.router import Endpoint, Route, Router, StopGeneration
from disagg.serving.wireclient import Result
from disagg_agents.decode.placement import Placement
from disagg_agents.prefix.store import BLOCK_TOKENS as BLOCK
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest
from tests.agenthelpers import in_flight, shared_len
from tests.agentpool import AgentSet

FETCH = {
    "prefill_time": 0.5,
    "kv_fetch_time": 0.52,
    "kv_bytes": 30_000_000,
    "kv_transfer_time": 0.5,
}


def chat(*contents: str, **kw: Any) -> GenerateRequest:
    roles = ["user", "assistant"]
    msgs = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return GenerateRequest(messages=msgs, **kw)


# --- the table and the rule, no agents ---------------------------------------------


def test_a_later_turn_matches_the_longest_remembered_prefix() -> None:
    t = AffinityTable()
    t.remember(prefix_keys("m", chat("hi")), "a")
    t.remember(prefix_keys("m", chat("hi", "hello", "how are you")), "b")
    # Turn 3 shares 3 messages with b's request, 1 with a's: b holds the longer prefix.
    turn3 = chat("hi", "hello", "how are you", "fine", "bye")
    agent, chars = t.match(prefix_keys("m", turn3))
    assert agent == "b"
    assert chars == prefix_keys("m", turn3)[2].chars
    # b served "hi" last (as its request's first message): the shared prefix is b's now.
    assert t.match(prefix_keys("m", chat("hi", "other")))[0] == "b"
    assert t.match(prefix_keys("m", chat("unrelated"))) == (None, 0)
    assert t.match(prefix_keys("other-model", turn3)) == (None, 0)


def test_what_the_template_puts_first_is_part_of_every_key() -> None:
    base = prefix_keys("m", chat("hi"))
    assert prefix_keys("m", chat("hi", system="be brief"))[0] != base[0]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert prefix_keys("m", chat("hi", tools=[tool]))[0] != base[0]
    assert prefix_keys("m", chat("hi"))[0] == base[0]  # and the same content, the same key


def test_different_salts_never_share_affinity() -> None:
    t = AffinityTable()
    t.remember(prefix_keys("m", chat("hi", cache_salt="alice")), "a")
    later = chat("hi", "hello", "more")
    assert t.match(prefix_keys("m", later.replace(cache_salt="bob"))) == (None, 0)
    assert t.match(prefix_keys("m", later))[0] is None  # no salt is a salt of its own
    assert t.match(prefix_keys("m", later.replace(cache_salt="alice")))[0] == "a"


def test_requests_the_agents_would_not_reuse_have_no_keys() -> None:
    assert prefix_keys("m", chat("hi", prefix_cache=False)) == []
    assert prefix_keys("m", chat("hi", kv_quant="int8")) == []


def test_a_raw_prompt_is_keyed_by_whole_chunks_of_its_text() -> None:
    c = affinity.CHUNK_CHARS
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * c + 10))
    keys = prefix_keys("m", GenerateRequest(prompt=text, raw=True))
    assert [k.chars for k in keys] == [c, 2 * c, 3 * c]
    longer = prefix_keys("m", GenerateRequest(prompt=text[: 2 * c] + "X" * c, raw=True))
    assert longer[:2] == keys[:2] and longer[2] != keys[2]
    assert prefix_keys("m", GenerateRequest(prompt=text[: c - 1], raw=True)) == []
    templated = prefix_keys("m", GenerateRequest(prompt=text, raw=False))
    assert templated[0] != keys[0]  # a chat template wraps it: other tokens


def test_the_table_forgets_the_least_recently_used_prefixes() -> None:
    t = AffinityTable(max_keys=4)
    old, new = prefix_keys("m", chat("a", "b")), prefix_keys("m", chat("c", "d", "e"))
    t.remember(old, "x")
    t.remember(new, "y")
    assert len(t) == 4
    # old's first key (its shortest prefix) went first; its longer one is still there.
    assert t.match(old[:1]) == (None, 0)
    assert t.match(old) == ("x", old[1].chars)
    t.match(old)  # now the most recently used
    t.remember(prefix_keys("m", chat("f")), "z")
    assert t.match(new[:1]) == (None, 0) and t.match(old)[0] == "x"


def test_the_affine_agent_wins_until_its_load_passes_the_slack() -> None:
    one_block = 100  # characters: any hit buys one stream of imbalance
    assert slack(one_block) == 1
    assert choose("a", one_block, {"a": 1, "b": 0}).agent == "a"
    spilled = choose("a", one_block, {"a": 2, "b": 0})
    assert spilled.agent is None and "serves 2 more than the least busy" in spilled.reason
    # A long remembered prefix is worth more imbalance: 4 slots of TOKENS_PER_SLOT tokens.
    big = 3 * affinity.TOKENS_PER_SLOT * affinity.CHARS_PER_TOKEN
    assert slack(big) == 4
    assert choose("a", big, {"a": 4, "b": 0}).agent == "a"
    assert choose("a", big, {"a": 5, "b": 0}).agent is None
    assert slack(10**9) == affinity.MAX_SLACK
    assert choose(None, 0, {"a": 0, "b": 0}).agent is None
    assert choose("gone", 500, {"a": 0}).agent is None  # not among the healthy


def endpoint(name: str) -> Endpoint:
    return Endpoint(name, "127.0.0.1", 1)


def test_the_router_puts_the_affine_agent_first_and_fails_over_past_it() -> None:
    r = Router([Route("m", [], [endpoint("a"), endpoint("b"), endpoint("c")])])
    keys = prefix_keys("m", chat("hi", "hello", "more"))
    r.affinity.remember(keys[:1], "b")
    r.busy.update({"b": 1, "c": 2})
    ordered, choice = r.decode_order(r.pipelines["m"].decode, keys)
    assert [e.name for e in ordered] == ["b", "a", "c"]  # affine, then least busy
    assert choice.agent == "b" and choice.busy == {"a": 0, "b": 1, "c": 2}
    r.busy["b"] = 2  # two more than a: past the slack of a short prefix
    assert [e.name for e in r.decode_order(r.pipelines["m"].decode, keys)[0]] == ["a", "b", "c"]
    r.busy["b"] = 0
    r.down_until["b"] = time.monotonic() + 60  # the affine agent is down: next, it last
    ordered, choice = r.decode_order(r.pipelines["m"].decode, keys)
    assert [e.name for e in ordered] == ["a", "c", "b"] and "is down" in choice.reason


def test_placement_weighs_only_the_tokens_past_a_prefix_hit() -> None:
    p = Placement()
    # 2,000 tok/s, 20 ms handshake, 1,000 bytes per token and layer at 60 MB/s.
    p.observe_remote("a:1", 1000, 30, FETCH)
    p.observe_local(1000, 0.5)  # 2,000 tok/s here too: local wins without a handshake
    assert p.choose("a:1", 1000)[0] == "local"  # 0.5 s here vs 0.537 s remote
    where, why = p.choose("a:1", 1000, cached=960)  # 40 tokens left: 0.041 s remote
    assert where == "remote" and "960 of 1000 tokens cached" in why


# --- real agents: a prefill agent and two decode agents serving the default model ---

LONG_STREAM = GenerateRequest(
    prompt="Count slowly:", raw=True, max_tokens=6000, ignore_eos=True, placement="remote"
)
TURNS = [
    "I am planning a week of hiking in the Alps in early autumn with two friends who have "
    "done some day hikes but never a multi-day route. We would like to sleep in mountain huts, "
    "keep each day under six hours of walking, and avoid glaciers. Which region would you "
    "suggest, and what should we pack?",
    "Thanks. Which hut-to-hut route in that region fits a week?",
    "And how fit do we need to be for it?",
]


@pytest.fixture(scope="module")
def cluster(smol_set: AgentSet) -> tuple[AgentProc, list[AgentProc]]:
    return smol_set.prefill, smol_set.decodes


@pytest.mark.slow
def test_a_chats_later_turns_stay_on_its_busier_agent_and_hit_its_cache(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    prefill, decodes = cluster
    a, b = decodes

    def ep(x: AgentProc) -> Endpoint:
        # No control port: no /health probe, whose 1 s timeout on a loaded test box
        # would reorder the agents; this test is about the prefix, not health.
        return Endpoint(x.name, x.host, x.port)

    router = Router([Route("smol", [ep(prefill)], [ep(a), ep(b)])], token=prefill.token)

    def turn(messages: list[dict[str, Any]]) -> GenerateRequest:
        # A tenant of its own: the shared agents' caches hold other tests' chat
        # templates, and this chat's first turn must find nothing.
        # Remote asked for: the pooled agents' placement has learned from earlier tests
        # (the decode agent's prefix hit applies either way).
        return GenerateRequest(
            messages=list(messages),
            max_tokens=16,
            return_prompt_ids=True,
            cache_salt="affinity",
            placement="remote",
        )

    messages: list[dict[str, Any]] = [{"role": "user", "content": TURNS[0]}]
    first = router.run("smol", turn(messages))
    assert first.metrics.decode_server == a.name  # both idle: the first listed
    assert first.metrics.cached_tokens == 0

    # Another stream, no remembered prefix: both idle again, so it lands on a too.
    stop = threading.Event()
    box: dict[str, Any] = {"tokens": 0}

    def count(_: TokenEvent) -> None:
        box["tokens"] += 1
        if stop.is_set():
            raise StopGeneration

    def long_stream() -> None:
        try:
            box["result"] = router.run("smol", LONG_STREAM, on_token=count)
        except StopGeneration:
            box["stopped"] = True

    worker = threading.Thread(target=long_stream, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while box["tokens"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert box["tokens"] >= 2, "the long stream did not start"
        previous: Result = first
        for text in TURNS[1:]:
            # The precondition, from the agents themselves: a busy, b idle (the
            # previous turn may take a moment to leave a's count).
            wait = time.monotonic() + 10
            while (in_flight(a), in_flight(b)) != (1, 0) and time.monotonic() < wait:
                time.sleep(0.05)
            assert (in_flight(a), in_flight(b)) == (1, 0)
            messages += [
                {"role": "assistant", "content": previous.text},
                {"role": "user", "content": text},
            ]
            res = router.run("smol", turn(messages))
            assert "result" not in box  # the long stream ran all along
            route = res.metrics.route or {}
            assert route["busy"] == {a.name: 1, b.name: 0}  # least busy would pick b
            assert route["agent"] == a.name and res.metrics.decode_server == a.name
            assert res.metrics.method == "disaggregated"
            # The hit, from the token ids: every whole block shared with the earlier turn.
            assert previous.prompt_ids and res.prompt_ids
            shared = min(shared_len(previous.prompt_ids, res.prompt_ids), len(res.prompt_ids) - 1)
            assert shared >= len(previous.prompt_ids) - 2  # the template only appends
            assert res.metrics.cached_tokens == shared // BLOCK * BLOCK > 0
            previous = res
    finally:
        stop.set()
        worker.join(120)
    assert box.get("stopped") and in_flight(b) == 0

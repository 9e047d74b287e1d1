"""The grammar compile queue under one tenant's flood, as units over in-process
Grammars on a real (small, trained here) tokenizer: a request whose budget runs
out while its compile is still queued answers (it once deadlocked the cache for
good), one tenant's flood leaves compiles for the others, a timeout is no
remembered refusal, and the cache is per tenant (a hit never tells one tenant
what another compiled)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from disagg_agents.decode.grammar import TENANT_COMPILES, Grammars
from disagg_agents.wire.request import RequestError
from tests.test_grammar import TOOLS, harmony_tokenizer, variant


@pytest.fixture
def grammars() -> Iterator[Grammars]:
    """A fresh one per test: a flood's sleeping builds must not reach the next test."""
    hf = harmony_tokenizer()
    ids: Any = hf.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    g = Grammars(hf, 320, ids, check=None)  # in-process: the fast tier starts no child
    g.warm()  # its tokenizer, built once (in the background)
    yield g


def slow(seconds: float, text: str = 'start: "yes" | "no"') -> Callable[[], str]:
    """A build that takes `seconds` (a stand-in for a big schema's compile)."""

    def build() -> str:
        time.sleep(seconds)
        import llguidance as llg

        return str(llg.LLMatcher.grammar_from_lark(text))

    return build


def until(cond: Callable[[], bool], seconds: float = 5.0) -> None:
    """Until cond() holds; the limit is a hang guard, not a speed bar."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.01)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """fn() on a daemon thread; the list gets its result or its exception."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_budget_that_runs_out_while_queued_answers_and_nothing_hangs(grammars: Grammars) -> None:
    # The tenant's share of the workers busy for 3 s...
    busy = [
        in_thread(partial(grammars.compile, f"busy{i}", slow(3.0), "tools"))
        for i in range(TENANT_COMPILES)
    ]
    until(lambda: grammars.snapshot()["compiling"] >= TENANT_COMPILES)
    # ...then a compile whose 0.3 s budget ends while it is still queued. Its
    # leaving once cancelled the queued job under the cache's lock, and the
    # cancel's callback took that lock again: this thread hung, and every later
    # compile and /status with it.
    grammars.budget_s = 0.3
    late, out = in_thread(lambda: grammars.compile("late", slow(0), "response_format"))
    late.join(10)
    assert not late.is_alive(), "compile() hung after its budget ran out in the queue"
    assert isinstance(out[0], RequestError) and "did not compile within 0.3s" in str(out[0])
    status, snap = in_thread(grammars.snapshot)
    status.join(5)
    assert not status.is_alive() and snap[0]["cached"] >= 0
    grammars.budget_s = 10.0
    for t, got in busy:
        t.join(10)
        assert not isinstance(got[0], BaseException), got
    # The timeout is no verdict on the grammar: it compiles once there is time.
    assert grammars.compile("late", slow(0), "response_format") is not None


def test_one_tenants_flood_leaves_compiles_for_the_others(grammars: Grammars) -> None:
    # A: 16 distinct slow grammars at once, each over a 1.5 s budget.
    grammars.budget_s = 1.5
    flood = [
        in_thread(
            partial(grammars.compile, f"flood{i}", slow(2.0, f'start: "v{i}"'), "x", tenant="A")
        )
        for i in range(16)
    ]
    # A holds its share of the workers, the rest of its flood queued.
    until(lambda: sum(grammars.queue.snapshot().values()) == 16)
    snap = grammars.snapshot()
    assert snap["compiling"] == TENANT_COMPILES and snap["queued"] == 16 - TENANT_COMPILES
    grammars.budget_s = 10.0

    def b_asks() -> float:
        t0 = time.monotonic()
        assert grammars.matcher({"type": "json_object"}, tenant="B") is not None
        assert grammars.matcher(None, tools=TOOLS, tool_choice="required", tenant="B")
        return time.monotonic() - t0

    during = b_asks()
    for t, _ in flood:
        t.join(30)
    outcomes = [type(got[0]).__name__ for _, got in flood]
    # Each A request waited its own budget at most: none hangs, most ran out.
    assert all(not t.is_alive() for t, _ in flood)
    assert outcomes.count("CompileTimeout") >= 16 - 2 * TENANT_COMPILES, outcomes
    after = time.monotonic()
    assert grammars.matcher({"type": "json_schema", "schema": variant(7)}, tenant="C")
    after = time.monotonic() - after
    print(
        f"B's json_object + tool compiles during A's flood: {during:.2f}s; C's after: {after:.2f}s"
    )
    assert during < 1.0 and after < 1.0
    # The queue drains: A's abandoned, queued compiles were dropped, not run.
    deadline = time.monotonic() + 10
    while sum(grammars.queue.snapshot().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sum(grammars.queue.snapshot().values())


def test_the_cache_is_per_tenant(grammars: Grammars) -> None:
    schema = {"type": "json_schema", "schema": variant(3)}
    misses = grammars.misses
    grammars.matcher(schema, tenant="A")
    grammars.matcher(schema, tenant="A")
    assert grammars.misses == misses + 1  # A's second use: a hit
    hits = grammars.hits
    grammars.matcher(schema, tenant="B")  # B's first use compiles, as A's did
    assert grammars.misses == misses + 2 and grammars.hits == hits
    grammars.matcher(schema, tenant="B")
    assert grammars.hits == hits + 1


# -- slow: through a keyed gateway to a real decode agent ------------------------------

KEYS = ("op-" + "o" * 24, "tenant-a-" + "a" * 24, "tenant-b-" + "b" * 24)


@pytest.mark.slow
def test_through_the_gateway_each_key_compiles_its_own(agent_pair: Any, gateways: Any) -> None:
    import uuid

    import httpx

    from tests.tinymodels import shared_tiny

    agents = agent_pair.set(shared_tiny("llama"))
    url = gateways.get({"tiny": agents}, api_keys=KEYS).url
    decode = agents.decodes[0]
    name = "k" + uuid.uuid4().hex[:8]  # a schema no earlier request compiled
    schema = {"type": "object", "properties": {name: {"enum": ["x", "y"]}}, "required": [name]}

    def ask(key: str) -> int:
        """The decode agent's compiles (misses) this request cost."""
        before = decode.status()["grammars"]["misses"]
        body = {
            "model": "tiny",
            "prompt": "Pick one.",
            "raw": True,
            "stream": False,
            "format": schema,
            "options": {"num_predict": 80},
        }
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{url}/api/generate", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["response"])[name] in ("x", "y")
        return int(decode.status()["grammars"]["misses"] - before)

    assert ask(KEYS[1]) == 1  # A's first use compiles
    assert ask(KEYS[1]) == 0  # A's second: its own cache
    assert ask(KEYS[2]) == 1  # B's first use compiles too: A's entry tells B nothing


def test_one_tenants_flood_cannot_flush_anothers_grammars(grammars: Grammars) -> None:
    grammars.cache_max_bytes = 4 * (300 << 10)  # about four small grammars' estimate
    grammars.compile("b-own", slow(0, 'start: "b"'), "tools", tenant="B")
    for i in range(12):  # A's stream of distinct schemas
        grammars.compile(f"a{i}", slow(0, f'start: "a{i}"'), "tools", tenant="A")
    hits = grammars.hits
    grammars.compile("b-own", slow(0, 'start: "b"'), "tools", tenant="B")
    assert grammars.hits == hits + 1  # B's grammar survived A's flood
    assert grammars.tenant_bytes["A"] <= grammars.cache_max_bytes // 2
    assert grammars.cache_bytes == sum(grammars.tenant_bytes.values()) <= grammars.cache_max_bytes


def test_a_tenant_alone_may_fill_the_grammar_cache(grammars: Grammars) -> None:
    grammars.cache_max_bytes = 4 * (300 << 10)
    for i in range(6):
        grammars.compile(f"alone{i}", slow(0, f'start: "c{i}"'), "tools", tenant="C")
    assert grammars.tenant_bytes["C"] > grammars.cache_max_bytes // 2

"""Faults during a request, with real agent processes: the prefill agent killed
mid-KV-stream, a decode agent killed mid-decode (alone, and with a sibling)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import AgentError
from disagg.serving.localagents import AgentProc, restart_agent
from disagg.serving.router import Route, Router
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest
from tests.agenthelpers import endpoint, in_flight
from tests.agentpool import AgentSet
from tests.conftest import PairFactory, ask, remote_request
from tests.slowprefill import SLOW_LAYER_S, SLOW_SET
from tests.tinymodels import PROMPT, shared_tiny

pytestmark = pytest.mark.slow

# Stretches the tiny model's 4-layer KV stream to >= 2.4 s: the slow set test_deadlines
# uses (an idle pooled one is handed over rather than another started).
LAYER_DELAY_S = SLOW_LAYER_S


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return shared_tiny("gpt_oss")


def wait_busy(agents: list[AgentProc], timeout_s: float = 30) -> AgentProc:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for agent in agents:
            if in_flight(agent):
                return agent
        time.sleep(0.02)
    raise AssertionError("no agent took the request")


@pytest.fixture(scope="module")
def slow_set(tiny_dir: Path, agent_pair: PairFactory) -> AgentSet:
    """This module's own set, stopped when it ends (test_deadlines' slow set, taken over
    if idle): the prefill test kills its prefill agent (with its first decode agent);
    the decode tests kill decode agents of their own share (the second; the third or
    fourth), prefilled by the pooled gpt_oss set's agent, so any order holds."""
    # The pool's token: its decode agents also talk to the pooled prefill agent.
    return agent_pair.set(tiny_dir, fresh=True, token_file=agent_pair.token_file, **SLOW_SET)


@pytest.fixture
def slow_prefill_pair(slow_set: AgentSet) -> tuple[AgentProc, AgentProc]:
    return slow_set.prefill, slow_set.decodes[0]


def test_prefill_killed_mid_kv_stream_falls_back_with_the_same_text(
    slow_prefill_pair: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = slow_prefill_pair
    req = remote_request(prefill, max_tokens=32)
    undisturbed = ask(decode, req)
    assert undisturbed.metrics.method == "disaggregated"

    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=ask(decode, req, timeout_s=60)))
    t0 = time.monotonic()
    worker.start()
    wait_busy([prefill])
    # Mid-way between layer 1 handed on (>= 1 delay) and layer 2 (>= 2): 0 and 1 are on
    # the wire, 2 and 3 are not.
    time.sleep(LAYER_DELAY_S * 1.5)
    os.kill(prefill.proc.pid, signal.SIGKILL)
    worker.join(60)
    res = box["r"]
    assert res.metrics.method == "local-fallback"
    assert "prefill stream from" in res.metrics.fallback_reason  # it died mid-stream
    assert res.metrics.fallback_kind == "stream"
    assert res.token_ids == undisturbed.token_ids
    assert time.monotonic() - t0 < 60  # hang guard


@pytest.fixture(scope="module")
def killable(
    tiny_dir: Path, slow_set: AgentSet, agent_pair: PairFactory
) -> tuple[AgentProc, list[AgentProc]]:
    """The pooled gpt_oss prefill agent (it outlives the prefill test's kill) and this
    module's decode agents (the set's own list: an agent restarted in it is stopped
    with the set): each test below kills decode agents of its own share (the second;
    the third or fourth), in any order."""
    prefill, _ = agent_pair(tiny_dir)
    return prefill, slow_set.decodes


@pytest.fixture
def lone_decode(killable: tuple[AgentProc, list[AgentProc]]) -> tuple[AgentProc, AgentProc]:
    prefill, decodes = killable
    return prefill, decodes[1]


LONG_DECODE = GenerateRequest(
    prompt=PROMPT, raw=True, max_tokens=3000, ignore_eos=True, placement="remote"
)


def test_decode_killed_alone_is_a_clear_error_within_the_timeout(
    lone_decode: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = lone_decode
    router = Router(
        [Route("tiny", [endpoint(prefill)], [endpoint(decode)], decode_timeout_s=30)],
        token=prefill.token,
    )
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            router.run("tiny", LONG_DECODE)
        except AgentError as e:
            box["error"] = e

    worker = threading.Thread(target=run)
    t0 = time.monotonic()
    worker.start()
    wait_busy([decode])
    time.sleep(0.3)
    os.kill(decode.proc.pid, signal.SIGKILL)
    worker.join(40)
    assert not worker.is_alive() and time.monotonic() - t0 < 30  # hang guard
    message = str(box["error"])
    assert "no decode agent of pipeline tiny could serve the request" in message
    assert decode.name in message


KILL_AT = 40  # answer tokens the client has when the serving agent is killed


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"]
)
def test_decode_killed_mid_answer_migrates_the_rest(
    killable: tuple[AgentProc, list[AgentProc]], sampling: dict[str, Any]
) -> None:
    """The serving agent is SIGKILLed after KILL_AT tokens: its sibling takes the prompt
    plus the tokens sent as its prompt and decodes only the rest; the client sees each
    token once, and the same text as an undisturbed run."""
    prefill, decodes = killable
    pair = decodes[2:]
    router = Router(
        [Route("tiny", [endpoint(prefill)], [endpoint(d) for d in pair])], token=prefill.token
    )
    req = LONG_DECODE.replace(max_tokens=240, **sampling)
    undisturbed = router.run("tiny", req)
    assert len(undisturbed.token_ids) == req.max_tokens
    made = {d.name: int(d.status()["completion_tokens"]) for d in pair}
    seen: list[int] = []
    serving: list[str] = []

    def on_token(t: TokenEvent) -> None:
        if t.metrics is not None and not serving:
            serving.append(str(t.metrics.decode_server))
        if t.id is None:
            return
        seen.append(t.id)
        if len(seen) == KILL_AT:
            victim = next(d for d in pair if d.name == serving[0])
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()

    res = router.run("tiny", req, on_token=on_token)
    victim_i = next(i for i, d in enumerate(pair) if d.name == serving[0])
    survivor = pair[1 - victim_i]
    assert len(seen) == req.max_tokens  # exactly max_tokens, each once
    assert seen == res.token_ids == undisturbed.token_ids  # no repeat, no gap, same text
    assert res.text == undisturbed.text
    assert res.metrics.migrations == 1
    assert res.metrics.rerouted_from and serving[0] in res.metrics.rerouted_from[0]
    assert res.metrics.decode_server == survivor.name
    sent_first = res.metrics.resumed_tokens or 0
    assert sent_first >= KILL_AT
    decoded_here = int(survivor.status()["completion_tokens"]) - made[survivor.name]
    assert decoded_here == req.max_tokens - sent_first <= req.max_tokens - KILL_AT + 1
    # The pair is whole again for the next test (the set stops it at the module's end).
    decodes[2 + victim_i] = restart_agent(pair[victim_i])


def test_a_request_past_its_migration_bound_fails_clearly(
    killable: tuple[AgentProc, list[AgentProc]],
) -> None:
    """max_migrations 0: the serving agent's death mid-answer is the request's end,
    one clear error; the sibling is never asked."""
    prefill, decodes = killable
    pair = decodes[2:]
    eps = [endpoint(d) for d in pair]
    router = Router(
        [Route("tiny", [endpoint(prefill)], eps, max_migrations=0)], token=prefill.token
    )
    made = {d.name: int(d.status()["requests"]) for d in pair}
    serving: list[str] = []
    count = [0]

    def on_token(t: TokenEvent) -> None:
        if t.metrics is not None and not serving:
            serving.append(str(t.metrics.decode_server))
        count[0] += t.id is not None
        if count[0] == KILL_AT:
            victim = next(d for d in pair if d.name == serving[0])
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()

    with pytest.raises(AgentError, match=r"max_migrations \(0\) reached"):
        router.run("tiny", LONG_DECODE.replace(max_tokens=240), on_token=on_token)
    victim_i = next(i for i, d in enumerate(pair) if d.name == serving[0])
    sibling = pair[1 - victim_i]
    assert int(sibling.status()["requests"]) == made[sibling.name]
    decodes[2 + victim_i] = restart_agent(pair[victim_i])

"""Misbehaving clients against real agents on 127.0.0.1: one that connects and
says nothing, one that hangs up mid-stream, and 200 mixed requests after which
no socket, thread or memory is left behind (measured from /proc)."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest

from disagg.errors import UsageError
from disagg.serving import wireclient as client
from disagg.serving.localagents import AgentProc
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.channel import recv_json
from disagg_agents.wire.frames import Frame
from tests.agenthelpers import in_flight
from tests.conftest import PairFactory, ask, log_since, log_size, remote_request
from tests.tinymodels import shared_tiny

pytestmark = [pytest.mark.fault, pytest.mark.slow]


# The agents' handshake deadline, set live for this module (their own is 5 s): the
# silent clients' test waits it out.
HANDSHAKE_S = 2.5
LIVE = ["--handshake-timeout", str(HANDSHAKE_S)]


@pytest.fixture(scope="module")
def agents(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(shared_tiny("gpt_oss"), prefill_args=LIVE, decode_args=LIVE)


def usage(agent: AgentProc) -> dict[str, int]:
    """Open fds, threads and resident memory (kB) of an agent process."""
    pid = agent.proc.pid
    rss = next(
        int(ln.split()[1])
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ln.startswith("VmRSS:")
    )
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss_kb": rss,
    }


def settle(
    agents: tuple[AgentProc, ...], baseline: dict[str, dict[str, int]], timeout_s: float = 20
) -> dict[str, dict[str, int]]:
    """Wait for fds and threads to come back to the baseline (connection threads end
    a moment after their sockets close)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {a.role: usage(a) for a in agents}
        back = all(
            now[r]["fds"] <= baseline[r]["fds"] and now[r]["threads"] <= baseline[r]["threads"]
            for r in now
        )
        if back or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_silent_clients_are_dropped_and_do_not_block(agents: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = agents
    reference = ask(decode, remote_request(prefill))
    connected = time.monotonic()
    silent = [
        socket.create_connection((a.host, a.port), timeout=30) for a in agents for _ in range(10)
    ]
    # Twenty idle connections do not stop real work.
    res = ask(decode, remote_request(prefill))
    assert res.token_ids == reference.token_ids
    for s in silent:
        s.settimeout(HANDSHAKE_S + 60)  # a hang guard: TimeoutError past it
        recv_json(s, Frame.CHALLENGE)  # the agent spoke first, then waited...
        assert s.recv(1) == b""  # ...and hung up on a client that never answered
        s.close()
    # Not before the handshake deadline the agents enforce (counted from their accept,
    # after `connected`).
    assert time.monotonic() - connected >= HANDSHAKE_S


def test_client_gone_mid_stream_stops_the_decode(agents: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = agents
    logged = log_size(decode)
    events = client.stream(
        decode.host, decode.port, remote_request(prefill, max_tokens=3000), token=decode.token
    )
    for _ in range(5):
        assert isinstance(next(events), TokenEvent)
    events.close()  # hang up after five of 3,000 tokens
    deadline = time.monotonic() + 10
    while in_flight(decode) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(decode) == 0, "the decode agent kept generating for nobody"
    assert "client went away" in log_since(decode, logged)
    res = ask(decode, remote_request(prefill))
    assert len(res.token_ids) == 8


def test_two_hundred_mixed_requests_leak_nothing(agents: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = agents
    reference = ask(decode, remote_request(prefill)).token_ids
    baseline = {a.role: usage(a) for a in agents}
    rng = random.Random(5)
    counts = {"ok": 0, "gone": 0, "bad": 0, "silent": 0, "fallback": 0}
    silent: list[socket.socket] = []
    for _ in range(200):
        kind = rng.choice(list(counts))
        if kind == "ok":
            res = ask(decode, remote_request(prefill))
            assert res.token_ids == reference
        elif kind == "gone":
            events = client.stream(
                decode.host,
                decode.port,
                remote_request(prefill, max_tokens=500),
                token=decode.token,
            )
            next(events)
            events.close()
        elif kind == "bad":
            with pytest.raises(UsageError):
                ask(decode, {"prompt": ""})
        elif kind == "silent":
            silent.append(socket.create_connection((prefill.host, prefill.port)))
        else:  # the prefill target is gone: the decode agent prefills itself
            req = {**remote_request(prefill), "prefill": {"host": "127.0.0.1", "port": 1}}
            res = ask(decode, req)
            assert res.metrics.method == "local-fallback" and res.token_ids == reference
        counts[kind] += 1
    for s in silent:
        s.close()
    while in_flight(decode):
        time.sleep(0.05)
    after = settle(agents, baseline)
    assert min(counts.values()) > 20, counts
    for role, used in after.items():
        base = baseline[role]
        assert used["fds"] <= base["fds"], (role, base, used)
        assert used["threads"] <= base["threads"], (role, base, used)
        assert used["rss_kb"] - base["rss_kb"] < 64 * 1024, (role, base, used)
    res = ask(decode, remote_request(prefill))
    assert res.token_ids == reference

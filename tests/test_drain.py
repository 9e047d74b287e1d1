"""Graceful stop: SIGTERM lets in-flight requests finish, refuses new ones, then exits."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import pytest

from disagg.serving.localagents import AgentProc
from tests.agentpool import AgentSet
from tests.conftest import PairFactory, ask, remote_request
from tests.slowprefill import slow_prefill
from tests.tinymodels import shared_tiny

pytestmark = [pytest.mark.fault, pytest.mark.slow]


def _refused_within(host: str, port: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=2).close()
        except (ConnectionRefusedError, ConnectionResetError):
            # Reset: the connect landed in the backlog as the listener closed.
            return True
        time.sleep(0.05)
    return False


def _wait_in_flight(agent: AgentProc, limit_s: float = 60.0) -> None:
    """Until the agent itself reports one request under way (the drain's precondition)."""
    deadline = time.monotonic() + limit_s
    while agent.status()["in_flight"] < 1:
        assert time.monotonic() < deadline, f"no request reached the {agent.role} agent"
        time.sleep(0.02)


# The KV stream of the 4-layer model is stretched to ~1.6 s so SIGTERM lands inside it.
SLOW = {"n_decode": 2, **slow_prefill(0.4)}


@pytest.fixture(scope="module")
def drained(agent_pair: PairFactory) -> AgentSet:
    """One set of this module's own (test_blas's slow set, taken over if idle): the
    decode test stops its second decode agent, on its own; the prefill test stops the
    prefill agent, asked by the first. Either may run first."""
    return agent_pair.set(shared_tiny("qwen3"), fresh=True, **SLOW)


def test_sigterm_drains_a_decode_in_flight(drained: AgentSet) -> None:
    decode = drained.decodes[1]
    req = {**remote_request(None, max_tokens=1500), "placement": "local"}
    reference = ask(decode, req)
    box: dict[str, Any] = {}
    seen: list[int] = []
    # SIGTERM from inside the stream, at its 20th token: whatever the hardware's speed,
    # the request is in flight then (the agent's own log line below says so too).
    sent = threading.Event()

    def on_token(_event: dict[str, Any]) -> None:
        seen.append(1)
        if len(seen) == 20:
            decode.proc.send_signal(signal.SIGTERM)
            sent.set()

    worker = threading.Thread(target=lambda: box.update(r=ask(decode, req, on_token=on_token)))
    worker.start()
    assert sent.wait(120), "the request never streamed 20 tokens"
    assert _refused_within(decode.host, decode.port, 30.0)  # no new work while draining
    worker.join(300)
    assert not worker.is_alive()
    assert box["r"].token_ids == reference.token_ids  # nothing lost
    assert decode.proc.wait(30) == 0
    log = decode.log_path.read_text()
    assert "decode draining: no new connections, waiting for 1 requests" in log, log
    assert "decode drained and stopped" in log


def test_sigterm_drains_a_prefill_in_flight(drained: AgentSet) -> None:
    prefill, decode = drained.pair
    req = remote_request(prefill, ignore_eos=False)
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=ask(decode, req)))
    worker.start()
    _wait_in_flight(prefill)  # the prefill agent holds the request: its KV stream is under way
    prefill.proc.send_signal(signal.SIGTERM)
    worker.join(120)
    assert not worker.is_alive()
    assert box["r"].metrics.method == "disaggregated"  # finished, not fallen back
    assert prefill.proc.wait(30) == 0
    log = prefill.log_path.read_text()
    # The agent counted the request as running when the signal came, and let it finish.
    assert "prefill draining: no new connections, waiting for 1 requests" in log, log
    assert "prefill drained and stopped" in log

"""Graceful stop: SIGTERM lets in-flight requests finish, refuses new ones, then exits."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import pytest

from tests.conftest import PairFactory, ask, remote_request

pytestmark = [pytest.mark.fault, pytest.mark.slow]


def _refused_within(host: str, port: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=2).close()
        except ConnectionRefusedError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_drains_a_decode_in_flight(agent_pair: PairFactory) -> None:
    prefill, decode = agent_pair("qwen3", seed=9)
    req = remote_request(prefill, max_tokens=1500)
    reference = ask(decode, req)
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=ask(decode, req)))
    worker.start()
    time.sleep(0.5)  # mid-decode
    decode.proc.send_signal(signal.SIGTERM)
    assert _refused_within(decode.host, decode.port, 5.0)  # no new work while draining
    assert worker.is_alive()  # ... while the old request is still being decoded
    worker.join(60)
    assert box["r"].token_ids == reference.token_ids  # nothing lost
    assert decode.proc.wait(30) == 0
    assert "decode drained and stopped" in decode.log_path.read_text()


def test_sigterm_drains_a_prefill_in_flight(agent_pair: PairFactory) -> None:
    # The KV stream of the 4-layer model is stretched to ~1.6 s so SIGTERM lands inside it.
    prefill, decode = agent_pair("qwen3", seed=9, prefill_args=["--fault-layer-delay", "0.4"])
    req = remote_request(prefill, ignore_eos=False)
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=ask(decode, req)))
    worker.start()
    time.sleep(0.5)  # the KV stream is under way (4 layers, 0.4 s apart)
    prefill.proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert box["r"].metrics["method"] == "disaggregated"  # finished, not fallen back
    assert prefill.proc.wait(30) == 0
    assert "prefill drained and stopped" in prefill.log_path.read_text()

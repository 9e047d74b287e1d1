"""Graceful stop: SIGTERM lets in-flight requests finish, refuses new ones, then exits."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from disagg.serving import wireclient as client
from disagg.serving.localagents import spawn_agent, start_local_pair, wait_ready
from tests.tinymodels import PROMPT, make_tiny

pytestmark = [pytest.mark.fault, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("qwen3", tmp_path_factory.mktemp("drain") / "m", seed=9)


def _refused_within(host: str, port: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=2).close()
        except ConnectionRefusedError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_drains_a_decode_in_flight(tiny_dir: Path, tmp_path: Path) -> None:
    prefill, decode = start_local_pair(tiny_dir, log_dir=tmp_path)
    try:
        req = {
            "prompt": PROMPT,
            "raw": True,
            "max_tokens": 1500,
            "ignore_eos": True,
            "placement": "remote",
            "prefill": {"host": prefill.host, "port": prefill.port},
        }
        reference = client.generate(decode.host, decode.port, req, token=decode.token)
        box: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: box.update(
                r=client.generate(decode.host, decode.port, req, token=decode.token)
            )
        )
        worker.start()
        time.sleep(0.5)  # mid-decode
        decode.proc.send_signal(signal.SIGTERM)
        assert _refused_within(decode.host, decode.port, 5.0)  # no new work while draining
        assert worker.is_alive()  # ... while the old request is still being decoded
        worker.join(60)
        assert box["r"].token_ids == reference.token_ids  # nothing lost
        assert decode.proc.wait(30) == 0
        assert "decode drained and stopped" in decode.log_path.read_text()
    finally:
        decode.stop()
        prefill.stop()


def test_sigterm_drains_a_prefill_in_flight(tiny_dir: Path, tmp_path: Path) -> None:
    prefill = wait_ready(
        "prefill",
        *spawn_agent(
            "prefill",
            tiny_dir,
            log_dir=tmp_path,
            name="prefill@127.0.0.1",
            extra_args=["--fault-layer-delay", "0.4"],
        ),
        timeout_s=120,
    )
    decode = wait_ready(
        "decode",
        *spawn_agent("decode", tiny_dir, log_dir=tmp_path, name="decode@127.0.0.1"),
        timeout_s=120,
    )
    try:
        req = {
            "prompt": PROMPT,
            "raw": True,
            "max_tokens": 8,
            "placement": "remote",
            "prefill": {"host": prefill.host, "port": prefill.port},
        }
        box: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: box.update(r=client.generate(decode.host, decode.port, req))
        )
        worker.start()
        time.sleep(0.5)  # the KV stream is under way (4 layers, 0.4 s apart)
        prefill.proc.send_signal(signal.SIGTERM)
        worker.join(60)
        assert box["r"].metrics["method"] == "disaggregated"  # finished, not fallen back
        assert prefill.proc.wait(30) == 0
        assert "prefill drained and stopped" in prefill.log_path.read_text()
    finally:
        decode.stop()
        prefill.stop()

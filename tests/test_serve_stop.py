"""Ctrl-C on a real `disagg serve --local` with a stream in flight, sent as a
terminal sends it, to the whole process group: the first says it drains and takes
no new requests, no agent takes the signal itself nor is restarted, and the process
exits within the drain deadline; a second stops at once. Either way: rc 130, no
traceback, no agent and no disagg temp dir left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from disagg.frontends.shutdown import CUT_GRACE_S
from tests.conftest import start_serve

pytestmark = pytest.mark.slow

DRAIN_S = 2  # the stream outlasts it by far; the process may not exit before it


def _streaming(base: str, got: list[str]) -> threading.Thread:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Tell me a very long story about the sea.",
        "options": {"num_predict": 4000, "temperature": 0.8, "seed": 3},
    }

    def read() -> None:
        try:
            with httpx.stream("POST", base + "/api/generate", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError as e:
            got.append(f"cut: {e}")

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def _serve_with_a_stream(
    tmp: Path, drain_s: float = DRAIN_S
) -> tuple[subprocess.Popen[bytes], str, list[int], list[str]]:
    log = tmp.parent / f"{tmp.name}-serve.log"
    proc, port = start_serve(
        "--drain-timeout", str(drain_s), log_path=log, env={"TMPDIR": str(tmp)}
    )
    base = f"http://127.0.0.1:{port}"
    agents = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(agents) >= 2, agents
    got: list[str] = []
    _streaming(base, got)
    deadline = time.monotonic() + 180
    while len(got) < 3:  # a few tokens are out: the stream is decoding
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    return proc, base, agents, got


def _left_behind(tmp: Path, agents: list[int]) -> tuple[list[str], list[int]]:
    dirs = [p.name for p in tmp.iterdir() if p.name.startswith("disagg-")]
    alive = [pid for pid in agents if psutil.pid_exists(pid) and _running(pid)]
    return dirs, alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_first_ctrl_c_drains_then_exits(default_model: Path, tmp_path: Path) -> None:
    proc, base, agents, got = _serve_with_a_stream(tmp_path)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process in its group
    at_signal = len(got)
    # No new requests: refused while it still drains (polled, not a fixed wait).
    deadline = time.monotonic() + 30  # a hang guard
    while True:
        try:
            httpx.get(base + "/health", timeout=3)
        except httpx.HTTPError:
            break
        assert time.monotonic() < deadline, "still answering /health after Ctrl-C"
        time.sleep(0.05)
    assert proc.poll() is None, "exited before the drain deadline"
    rc = proc.wait(DRAIN_S + 120)  # a hang guard: TimeoutExpired past it
    took = time.monotonic() - t0
    said = (tmp_path.parent / f"{tmp_path.name}-serve.log").read_text()
    print(f"drained and exited {took:.1f} s after Ctrl-C (drain deadline {DRAIN_S} s)")
    assert rc == 130, said
    assert "draining 1 request" in said and "Traceback" not in said, said
    # The agents were not in the group: none exited mid-drain, none was restarted.
    assert "restarting" not in said and " is back " not in said, said
    assert "no agent is restarted from now on" in said, said
    # It drained: the stream went on after the signal, and the process did not exit
    # before the drain deadline it enforces (a 4000-token stream outlasts it).
    assert len(got) > at_signal + 1, (at_signal, got[-3:])
    assert took >= DRAIN_S, took
    # Within the drain: its deadline, the cut requests' grace, the agents' own stop
    # (an agent restarted mid-drain made it 22-25 s).
    assert took < DRAIN_S + CUT_GRACE_S + 5, took
    assert _left_behind(tmp_path, agents) == ([], [])
    last = json.loads(next(g for g in reversed(got) if g.startswith("{")))
    assert last["done"] is True and last["done_reason"] == "cancelled", got[-3:]


def test_second_ctrl_c_stops_at_once(default_model: Path, tmp_path: Path) -> None:
    # A drain deadline far past the wait below: only the second Ctrl-C can end it there.
    proc, _, agents, _ = _serve_with_a_stream(tmp_path, drain_s=600)
    os.killpg(proc.pid, signal.SIGINT)
    log = tmp_path.parent / f"{tmp_path.name}-serve.log"
    deadline = time.monotonic() + 30  # a hang guard
    while "Ctrl-C again to stop now)" not in log.read_text():  # the first one is handled
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(120)  # TimeoutExpired if it waited for the drain
    took = time.monotonic() - t0
    print(f"second Ctrl-C: exited {took:.1f} s after it (drain deadline 600 s)")
    said = (tmp_path.parent / f"{tmp_path.name}-serve.log").read_text()
    assert rc == 130 and "Traceback" not in said, said
    after_drain = said.split("Ctrl-C again to stop now)", 1)[1].strip()
    assert after_drain.startswith("stopped at once") and after_drain.count("\n") == 0, said
    assert _left_behind(tmp_path, agents) == ([], [])

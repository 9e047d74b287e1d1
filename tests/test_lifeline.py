"""Local agents never outlive `disagg serve --local`: SIGTERM stops them as Ctrl-C
does (an agent the gateway restarted too), and a SIGKILLed gateway's agents notice
and exit (disagg_agents/runtime/lifeline.py). A killed agent is logged and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ServeProcess
from tests.tinymodels import shared_tiny

pytestmark = [pytest.mark.slow, pytest.mark.fault]

GONE_WITHIN_S = 15.0


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def children(pid: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def start_with_agents(
    serve: ServeProcess, model: Path, log: Path
) -> tuple[subprocess.Popen[bytes], int, list[int]]:
    """A real `disagg serve --local` on a free port; returns it, its port and its
    agents' pids once it answers."""
    proc, port = serve("-m", str(model), log_path=log)
    agents = children(proc.pid)
    assert len(agents) == 2, f"expected a prefill and a decode agent, got {agents}"
    return proc, port, agents


def ask(port: int, model: Path) -> str:
    """One chat through the gateway, its K/V on the wire if it can be: the method."""
    chat = {
        "model": model.name,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4,
        "placement": "remote",
    }
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=300)
    assert r.status_code == 200, r.text
    return str(r.json()["disagg_metrics"]["method"])


def restart_decode(proc: subprocess.Popen[bytes], port: int, model: Path, log: Path) -> int:
    """Kill the gateway's decode agent: it is logged, restarted, and the next requests
    are disaggregated again, through the new one. Returns the new agent's pid. (The
    decode agent: it starts in a third of the prefill agent's time, no torch.)"""
    [decode] = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "disagg_agents.decode" in " ".join(p.cmdline())
    ]
    decode.kill()
    deadline = time.monotonic() + 240
    while "is back on" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    assert "decode agent decode@127.0.0.1 exited (killed by SIGKILL)" in log.read_text()
    while (method := ask(port, model)) != "disaggregated":  # the router re-probes it
        assert time.monotonic() < deadline, (method, log.read_text())
        time.sleep(0.25)  # polled: the router skips a failed agent for 5 s
    [again] = [
        p.pid
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "disagg_agents.decode" in " ".join(p.cmdline())
    ]
    assert again != decode.pid
    return again


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_agents_die_with_serve(
    tmp_path: Path, serve_process: ServeProcess, sig: signal.Signals
) -> None:
    model, log = shared_tiny("qwen3"), tmp_path / "serve.log"
    proc, port, agents = start_with_agents(serve_process, model, log)
    try:
        if sig == signal.SIGTERM:  # and an agent it restarted dies with it too
            agents.append(restart_decode(proc, port, model, log))
        proc.send_signal(sig)
        proc.wait(GONE_WITHIN_S)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(p) for p in agents) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in agents if alive(p)], (tmp_path / "serve.log").read_text()
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM
    finally:
        for p in agents:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()

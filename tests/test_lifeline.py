"""Local agents never outlive `disagg serve --local`: SIGTERM stops them as Ctrl-C
does, and a SIGKILLed gateway's agents notice and exit (agents/runtime/lifeline.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

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
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A real `disagg serve --local` on a free port; returns it and its agents' pids
    once it answers."""
    proc, _ = serve("-m", str(model), log_path=log)
    agents = children(proc.pid)
    assert len(agents) == 2, f"expected a prefill and a decode agent, got {agents}"
    return proc, agents


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_agents_die_with_serve(
    tiny_model: Callable[..., Path],
    tmp_path: Path,
    serve_process: ServeProcess,
    sig: signal.Signals,
) -> None:
    model = shared_tiny("qwen3")
    proc, agents = start_with_agents(serve_process, model, tmp_path / "serve.log")
    try:
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

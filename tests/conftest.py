"""Shared fixtures: the converted default model (cached across runs) and real
agents as processes on 127.0.0.1, shared across a test module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from disagg.serving import wireclient as client
from disagg.serving.defaultmodel import ensure_default_model
from disagg.serving.localagents import AgentProc, free_port, start_local_pair
from tests.tinymodels import PROMPT, make_tiny

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model() -> Path:
    # Converted once per machine into DISAGG_CACHE (or ~/.cache/disagg) and reused.
    return ensure_default_model()


@pytest.fixture(scope="module")
def smol_agents(default_model: Path, agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(default_model)


def ask(
    decode: AgentProc, req: dict[str, Any], *, prefill: AgentProc | None = None, **kw: Any
) -> client.Result:
    """One request to a live decode agent with its token; prefilled by `prefill`
    when given. `kw` goes to the wire client (on_text, on_token, timeout_s...)."""
    if prefill is not None:
        req = {**req, "prefill": {"host": prefill.host, "port": prefill.port}}
    return client.generate(decode.host, decode.port, req, token=decode.token, **kw)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model("gpt_oss", seed=8, sliding_window=8)`: that tiny seeded random
    checkpoint, made once per session for the same arguments."""
    root = tmp_path_factory.mktemp("tiny")
    made: dict[str, Path] = {}

    def make(arch: str, seed: int = 0, **config: Any) -> Path:
        key = f"{arch}-{seed}-" + "-".join(f"{k}={config[k]}" for k in sorted(config))
        if key not in made:
            made[key] = make_tiny(arch, root / f"m{len(made)}", seed=seed, **config)
        return made[key]

    return make


PairFactory = Callable[..., tuple[AgentProc, AgentProc]]


@pytest.fixture(scope="module")
def agent_pair(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[..., Path]
) -> Iterator[PairFactory]:
    """Start prefill + decode agent pairs; all stopped when the module ends.

    `agent_pair(path)` serves a model dir; `agent_pair("gpt_oss", seed=8,
    config={"sliding_window": 8})` serves that tiny checkpoint. Other keywords go
    to start_local_pair (dtype, token_file, prefill_args, decode_args).
    """
    root = tmp_path_factory.mktemp("pairs")
    started: list[tuple[AgentProc, AgentProc]] = []

    def start(
        model: str | Path, *, seed: int = 0, config: dict[str, Any] | None = None, **kw: Any
    ) -> tuple[AgentProc, AgentProc]:
        path = model if isinstance(model, Path) else tiny_model(model, seed, **(config or {}))
        kw.setdefault("log_dir", root / f"logs-{len(started)}")
        pair = start_local_pair(path, **kw)
        started.append(pair)
        return pair

    try:
        yield start
    finally:
        for pair in reversed(started):
            for agent in reversed(pair):
                agent.stop()


def remote_request(
    prefill: AgentProc | dict[str, Any] | None,
    prompt: str = PROMPT,
    max_tokens: int = 8,
    **fields: Any,
) -> dict[str, Any]:
    """A raw-prompt request of exactly `max_tokens` (EOS ignored) that the decode
    agent must prefill at `prefill` (an agent or a target dict); greedy unless told."""
    req = {
        "prompt": prompt,
        "raw": True,
        "max_tokens": max_tokens,
        "placement": "remote",
        "ignore_eos": True,
        **fields,
    }
    if isinstance(prefill, AgentProc):
        req["prefill"] = {"host": prefill.host, "port": prefill.port}
    elif prefill is not None:
        req["prefill"] = prefill
    return req


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected sockets with a 5 s timeout: frames on a real socket, no agent."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


class LocalServer:
    """A TCP listener on 127.0.0.1 (port 0) whose accept loop hands each
    connection to `on_connection` in its own thread; for fake peers and relays."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self.on_connection, args=(conn,), daemon=True).start()

    def on_connection(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()


def start_serve(
    *args: str, log_path: Path, timeout_s: float = 300, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """`disagg serve --local ARGS` as a real process on a free port, returned once
    it answers there. The caller stops it (SIGTERM stops its agents too). `env` adds
    to the environment (TMPDIR=dir: its agents' logs land in dir/disagg-logs-*)."""
    port = free_port()
    cmd = [sys.executable, "-m", "disagg.cli", "serve", "--local", *args, "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"disagg serve did not start:\n{log_path.read_text()}") from None
            time.sleep(0.3)

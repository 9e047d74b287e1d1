"""The gateway in this process: `create_app` under uvicorn on a thread, over agent
sets the test session already runs; what `disagg serve` does, less the process.

A gateway is keyed by what it serves and how (models, API keys, workers): tests
asking for the same one share it, as they share agent sets. What `disagg serve`
would write to its stderr (uvicorn's, asyncio's and disagg's records) is kept in
memory, one log for every gateway of the session: tests run one at a time, so the
lines a test reads since it began (`log_mark()`, `log(since)`) are its own.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from disagg.api import Client
from disagg.frontends.app import create_app
from disagg.frontends.limits import (
    Admission,
    Limits,
    OncePer,
    connection_cap,
    limited_protocol,
    raise_nofile,
)
from disagg.frontends.workers import Workers
from disagg.serving.localagents import AgentProc, free_port
from disagg.serving.router import Endpoint, Route, Router
from tests.agentpool import AgentSet

LOGGERS = ("uvicorn", "asyncio", "disagg")


class Recording(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


RECORDING = Recording()
for _name in LOGGERS:
    logging.getLogger(_name).addHandler(RECORDING)
for _name in ("asyncio", "uvicorn.error"):  # as disagg.frontends.limits.serve
    logging.getLogger(_name).addFilter(OncePer())
for _name in ("disagg.requests", "disagg.agents"):  # the lines `disagg serve` shows
    logging.getLogger(_name).setLevel(logging.INFO)


@dataclass(frozen=True)
class GatewayKey:
    models: tuple[tuple[str, int], ...]  # (served name, its prefill agent's pid)
    n_decode: int = 1
    api_keys: tuple[str, ...] = ()
    workers: int | None = None
    max_requests: int | None = None


@dataclass(eq=False)
class Gateway:
    url: str  # http://127.0.0.1:PORT (OpenAI under /v1, Ollama under /api)
    client: Client
    server: uvicorn.Server
    thread: threading.Thread
    sets: dict[str, AgentSet] = field(default_factory=dict)  # served name -> its agents

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @staticmethod
    def log_mark() -> int:
        return len(RECORDING.lines)

    @staticmethod
    def log(since: int = 0) -> str:
        """The gateways' log lines from mark `since` on."""
        return "\n".join(RECORDING.lines[since:])

    def decode(self, model: str | None = None, i: int = 0) -> AgentProc:
        """The i-th decode agent serving `model` (the only model when None)."""
        agent_set = self.sets[model] if model else next(iter(self.sets.values()))
        return agent_set.decodes[i]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class PooledClient(Client):
    """A Client over agents someone else stops: close() leaves them running."""

    def close(self) -> None:
        self.agents = []


def client_over(
    sets: dict[str, AgentSet],
    token: bytes,
    n_decode: int = 1,
    model_dirs: dict[str, Path] | None = None,
) -> PooledClient:
    """What `Client.local` builds over the agents it starts, over these sets."""
    routes, agents = [], []
    for name, s in sets.items():
        decodes = s.decodes[:n_decode]
        agents += [s.prefill, *decodes]
        routes.append(
            Route(
                name,
                [Endpoint(s.prefill.name, s.prefill.host, s.prefill.port, s.prefill.control_port)],
                [Endpoint(d.name, d.host, d.port, d.control_port) for d in decodes],
                integrity="none",  # as Client.local: both ends on this machine's loopback
            )
        )
    client = PooledClient(router=Router(routes, token=token))
    client.agents = agents
    client.model_dirs = model_dirs or {name: s.key.model for name, s in sets.items()}
    return client


def start_gateway(
    client: Client,
    *,
    api_keys: Sequence[str] = (),
    workers: int | None = None,
    max_requests: int | None = None,
    limits: Limits | None = None,
) -> Gateway:
    """`disagg serve`'s app and server settings (disagg.frontends.limits.serve) on a
    thread of this process, on a free port; returned once it accepts connections."""
    limits = limits or Limits()
    pool = Workers.for_router(client.router, workers, max_requests)
    app = create_app(client, api_key=list(api_keys) or None, workers=pool)
    cap = connection_cap(limits, raise_nofile())
    admission = Admission(cap, min(limits.max_per_address, cap))
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        log_config=None,  # records go to the loggers (RECORDING), not to a stderr of ours
        http=limited_protocol(limits, admission),
        backlog=min(2048, cap),
        # At the session's end a connection some test left open must not hold the
        # stop for join()'s 30 s (`disagg serve` sets its own, from its drain deadline).
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True, name=f"gateway-{port}")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process gateway did not start:\n" + Gateway.log())
        time.sleep(0.02)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    return Gateway(f"http://127.0.0.1:{port}", client, server, thread)


class Gateways:
    """Session-wide gateways keyed by what they serve: get() starts one on first use."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.started: dict[GatewayKey, Gateway] = {}

    def get(
        self,
        models: dict[str, AgentSet],
        *,
        n_decode: int = 1,
        api_keys: Sequence[str] = (),
        workers: int | None = None,
        max_requests: int | None = None,
    ) -> Gateway:
        key = GatewayKey(
            tuple((name, s.prefill.proc.pid) for name, s in models.items()),
            n_decode,
            tuple(api_keys),
            workers,
            max_requests,
        )
        if key not in self.started:
            client = client_over(models, self.token, n_decode)
            gw = start_gateway(
                client, api_keys=api_keys, workers=workers, max_requests=max_requests
            )
            gw.sets = dict(models)
            self.started[key] = gw
        return self.started[key]

    def close(self) -> None:
        for gw in self.started.values():
            gw.stop()
        self.started.clear()


def fleet_inventory(d: Path, agents: AgentSet, model: Path) -> Path:
    """An inventory whose one pipeline is these (pooled) agents on this machine."""
    p, dec = agents.prefill, agents.decodes[0]
    path = d / "inventory.toml"
    path.write_text(
        f"""
[ssh]
config = ""
known_hosts = "{d}/known_hosts"

[hosts.p]
ssh = "127.0.0.1"
data = ["127.0.0.1"]
roles = ["prefill"]
prefill = {{ port = {p.port}, control_port = {p.control_port} }}

[hosts.d]
ssh = "127.0.0.1"
data = ["127.0.0.1"]
roles = ["decode"]
decode = {{ port = {dec.port}, control_port = {dec.control_port} }}

[pipelines.{model.name}]
prefill = ["p"]
decode = ["d"]
prefill_model = "{model}"
decode_model = "{model}"
"""
    )
    return path


@contextmanager
def fleet_gateway(
    d: Path,
    agents: AgentSet,
    model: Path,
    token_file: Path,
    args: Sequence[str],
    preexec: Callable[[], None] | None = None,
) -> Iterator[tuple[str, Path]]:
    """`disagg serve -i INVENTORY ARGS` as a process in `d`, a fleet's gateway over
    these agents (`fleet_inventory`): its base URL and log, once /health answers;
    stopped with SIGTERM after. For tests of the gateway process itself."""
    port, log = free_port(), d / "serve.log"
    cmd = [
        sys.executable, "-m", "disagg.cli", "serve",
        "-i", str(fleet_inventory(d, agents, model)), *args, "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "DISAGG_TOKEN_FILE": str(token_file)}
    env.pop("DISAGG_INVENTORY", None)  # the inventory given, never the real cluster's
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec, env=env
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"disagg serve did not start:\n{log.read_text()}")
        time.sleep(0.05)
    try:
        yield base, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the `gateway` fixture (tests/conftest.py): one per module, as its GATEWAY says ----

SMOL = "SmolLM2-135M-Instruct"  # the pooled default model's served name


@dataclass(frozen=True)
class ServeSpec:
    """`disagg serve` as a process of the module's own (a fleet's gateway over the
    pooled SmolLM2 set): for tests of the process itself, its limits and floods."""

    keys: tuple[str, ...]  # written to an --api-key-file, one a line
    args: tuple[str, ...] = ()  # after `--api-key-file FILE`
    preexec: Callable[[], None] | None = None  # in the child, before it runs
    before: Callable[[], None] | None = None  # in this process, before the start


@dataclass(frozen=True)
class GatewaySpec:
    """What a module's `gateway` serves over the pooled SmolLM2 set. By default the
    session's shared in-process gateway of these settings (`Gateways.get`); `own`
    starts one for the module alone (its metrics, rows and log are its requests');
    `serve` a `disagg serve` process (`ServeGateway`)."""

    n_decode: int = 1
    workers: int | None = None
    max_requests: int | None = None
    own: bool = False
    serve: ServeSpec | None = None


@dataclass(frozen=True)
class ServeGateway:
    """A `disagg serve` process: its base URL, its log, the agents it serves."""

    url: str
    log: Path
    agents: AgentSet


@contextmanager
def module_gateway(
    spec: GatewaySpec, gateways: Gateways, smol: AgentSet, token_file: Path, model: Path, d: Path
) -> Iterator[Gateway | ServeGateway]:
    """The gateway `spec` asks for; `d` is the module's own folder."""
    if spec.serve is not None:
        serve = spec.serve
        if serve.before is not None:
            serve.before()
        keys = d / "keys"
        lines = "".join(f"{k}\n" for k in serve.keys)
        keys.write_text(f"# one key a line, the first the operator's\n{lines}")
        keys.chmod(0o600)
        args = ["--api-key-file", str(keys), *serve.args]
        with fleet_gateway(d, smol, model, token_file, args, serve.preexec) as (url, log):
            yield ServeGateway(url, log, smol)
    elif spec.own:
        gw = start_gateway(
            client_over({SMOL: smol}, gateways.token, spec.n_decode),
            workers=spec.workers,
            max_requests=spec.max_requests,
        )
        gw.sets = {SMOL: smol}
        try:
            yield gw
        finally:
            gw.stop()
    else:
        yield gateways.get(
            {SMOL: smol},
            n_decode=spec.n_decode,
            workers=spec.workers,
            max_requests=spec.max_requests,
        )

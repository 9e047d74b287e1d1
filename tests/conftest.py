"""Shared fixtures: the converted default model (cached across runs), tiny seeded
checkpoints (cached likewise), real agents as processes on 127.0.0.1 from a
session-wide pool (tests/agentpool.py), in-process gateways over them
(tests/gateways.py), and the hooks that mark every test starting a process `slow`
and count the agent sets a run starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# First, before anything loads mlx: the mlx references computed in this process run
# on OpenBLAS as the decode agent does, not on mlx's Linux wheel's reference BLAS
# (a 1,353-token SmolLM2 reference took 89 s on it).
import disagg_agents.runtime.fastblas  # noqa: F401
import tests.agentpool
from disagg.serving import wireclient as client
from disagg.serving.defaultmodel import ensure_default_model
from disagg.serving.localagents import AgentProc, free_port, spawn_agent, stop_agents
from tests.agentpool import STARTED, STARTS, AgentPool, AgentSet, count_start, key_for
from tests.gateways import Gateway, Gateways, GatewaySpec, ServeGateway, module_gateway
from tests.tinymodels import PROMPT, tiny_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# gpt-oss prompts state the date: a random model's greedy answer must not change with it.
os.environ.setdefault("DISAGG_TODAY", "2026-11-29")
pytest_plugins = ["tests.ordering"]  # story modules keep their order under a shuffle

# Fixtures that start processes (agents, `disagg serve`, a Python): a test using
# any of them, directly or through another fixture, is marked `slow`.
PROCESS_FIXTURES = {
    "agent_pool",
    "spawn",
    "spawn_module",
    "serve_process",
    "python_process",
    "testbed",
}


# Before `-m` deselects (this hook runs ahead of pytest's own): marks decide the tiers.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, under `-n`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from tests.twoworkers import TestBedBeside

    return TestBedBeside(config, log)


# Counted apart: what happened to pooled sets, and agents that never came up.
NOT_SETS = ("evicted", "taken over", "refused")
# Seconds the session's shared gateways and agents took to stop (the summary prints
# them: they land on whichever test runs last, the test bed's restart).
STOPPED_IN: dict[str, float] = {}


# Skips for want of something CI provides (.ci/run: apt's chromium, npm's agent CLIs,
# the dev extra's openai-harmony, root for the test bed): under CI=true they fail, so a
# broken install cannot turn green by skipping. Matched on the skip's reason.
CI_PROVIDES = (
    "(CI installs both)",
    ".ci/run installs them",
    "openai_harmony",
    "the test bed needs root",
    "no system OpenBLAS here",  # .ci/run installs libopenblas0-pthread
)


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report: pytest.TestReport = yield
    if report.skipped and _on_ci() and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if any(what in reason for what in CI_PROVIDES):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, but CI provides what it needs: {reason}"
    return report


def _skips_by_reason(terminalreporter: Any) -> None:
    """One line per reason (pytest's own summary needs -rs and splits by line)."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = _skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    if counts:
        terminalreporter.write_line(f"skipped, by reason ({sum(counts.values())} in all):")
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"  {n:4d}  {reason}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker: hand the counts to the controller, which prints them."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["disagg_counts"] = (dict(STARTS), list(STARTED), dict(STOPPED_IN))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a worker has finished
def pytest_testnodedown(node: Any, error: Any) -> None:
    starts, started, stopped = getattr(node, "workeroutput", {}).get("disagg_counts", ({}, [], {}))
    STARTS.update(starts)
    STARTED.extend(tuple(s) for s in started)
    for what, seconds in stopped.items():  # the workers stop theirs at the same time
        STOPPED_IN[what] = max(STOPPED_IN.get(what, 0.0), seconds)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _skips_by_reason(terminalreporter)
    started = {k: v for k, v in STARTS.items() if k not in NOT_SETS}
    if not started:
        return
    # On this machine, then the test bed's hosts apart (its fleet commands start
    # agents in its namespaces, not here).
    here = {k: v for k, v in started.items() if k != "fleet"}
    parts = ", ".join(f"{k} {v}" for k, v in sorted(here.items()))
    line = f"agent-set starts: {sum(here.values())} on this machine ({parts})"
    if started.get("fleet"):
        line += f", {started['fleet']} on the test bed's hosts; {sum(started.values())} in all"
    notes = [f"{STARTS[k]} {k}" for k in ("evicted", "taken over") if STARTS[k]]
    more = f"; pooled sets {', '.join(notes)}" if notes else ""
    if STARTS["refused"]:
        more += f"; {STARTS['refused']} agent starts refused before loading anything"
    terminalreporter.write_line(line + more)
    if STOPPED_IN:
        stops = ", ".join(f"{k} {v:.1f} s" for k, v in STOPPED_IN.items())
        terminalreporter.write_line(f"stopped at the session's end: {stops}")
    # Where each came from, for whoever wants the count down: DISAGG_TEST_STARTS=FILE.
    detail = os.environ.get("DISAGG_TEST_STARTS")
    if detail:
        Path(detail).write_text("".join(f"{k}\t{w}\t{t}\n" for k, w, t in STARTED))


def pytest_runtest_setup(item: pytest.Item) -> None:
    tests.agentpool.CURRENT_TEST = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Sets a test's body leases (agent_pair(...) in the test) are held until it ends,
    not until its module does: the next test may lease them with other live settings."""
    tests.agentpool.BODY_LEASES = []
    try:
        return (yield)
    finally:
        taken, tests.agentpool.BODY_LEASES = tests.agentpool.BODY_LEASES, None
        for owner, leased in taken:
            owner.give_back(leased)


@pytest.fixture(autouse=True)
def _processes_only_when_slow(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test not marked slow that starts a Python process fails: the fast tier
    (`-m "not slow"`) stays free of processes because the marks are true."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    real = subprocess.Popen.__init__

    def guarded(self: Any, args: Any, *a: Any, **kw: Any) -> None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        if argv and Path(str(argv[0])).name.startswith("python"):
            raise AssertionError(
                f"{request.node.nodeid} starts a Python process ({argv[:4]}) but is not "
                "marked slow: use a process fixture (python_process, spawn, ...) or the mark"
            )
        real(self, args, *a, **kw)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def default_model() -> Path:
    # Converted once per machine into DISAGG_CACHE (or ~/.cache/disagg) and reused.
    return ensure_default_model()


TinyModel = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model() -> TinyModel:
    """`tiny_model("gpt_oss", seed=8, sliding_window=8)`: that tiny seeded random
    checkpoint, written once per machine (tests/tinymodels.tiny_checkpoint)."""
    return tiny_checkpoint


# ---- agents ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def agent_pool(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path
) -> Iterator[AgentPool]:
    # The default model's sets have two decode agents: one set serves one-agent
    # tests and two-agent routers and gateways alike.
    pool = AgentPool(
        tmp_path_factory.mktemp("pool"),
        widths={default_model: 2},
        pinned={key_for(default_model, n_decode=2)},
    )
    try:
        yield pool
    finally:
        t0 = time.monotonic()
        pool.close()
        STOPPED_IN["pooled agents"] = time.monotonic() - t0


class Agents:
    """Agent sets for tests: `agents(model)` or `agents.set(model, n_decode=2)`.

    `model` is a model dir, or a tiny architecture ("gpt_oss") made with `seed` and
    `config` (e.g. {"sliding_window": 8}). Pooled sets are shared with every test of
    the same configuration, in one cluster (`token_file`); `fresh=True` starts a set
    of the caller's own (its own token unless `token_file` is given), stopped when
    this factory's scope ends: ask for one to stop, kill, drain or restart an agent.
    """

    def __init__(self, pool: AgentPool, root: Path, fresh: bool = False) -> None:
        self.pool, self.root, self.fresh_default = pool, root, fresh
        self.leased: list[AgentSet] = []
        self.own: list[AgentSet] = []

    @property
    def token_file(self) -> Path:
        return self.pool.token_file

    def set(
        self,
        model: str | Path,
        *,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        dtype: str = "auto",
        n_decode: int = 1,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        fresh: bool | None = None,
        token_file: Path | None = None,
        prefill_module: str | None = None,
    ) -> AgentSet:
        path = model if isinstance(model, Path) else tiny_checkpoint(model, seed, **(config or {}))
        key = key_for(
            path,
            dtype=dtype,
            n_decode=n_decode,
            prefill_args=prefill_args,
            decode_args=decode_args,
            prefill_module=prefill_module,
        )
        if fresh if fresh is not None else self.fresh_default:
            made = self.pool.fresh(key, self.root / f"fresh-{len(self.own)}", token_file)
            self.own.append(made)
            return made
        if token_file is not None:
            raise ValueError("pooled sets share the pool's token (agents.token_file): fresh=True")
        leased = self.pool.lease(key)
        self.leased.append(leased)
        if tests.agentpool.BODY_LEASES is not None:
            tests.agentpool.BODY_LEASES.append((self, leased))
        return leased

    def give_back(self, leased: AgentSet) -> None:
        """Release one lease now (a test's body lease, when the test ends)."""
        self.leased.remove(leased)
        self.pool.release(leased)

    def __call__(self, model: str | Path, **kw: Any) -> tuple[AgentProc, AgentProc]:
        """A prefill and a decode agent; keywords as for set()."""
        return self.set(model, **kw).pair

    def close(self) -> None:
        stop_agents([a for s in self.own for a in s.agents])
        for leased in self.leased:
            self.pool.release(leased)
        self.own, self.leased = [], []


PairFactory = Agents

# The default model in bfloat16, its prefill agent cutting a peer that takes no K/V
# after SMOL_STALL_S (not the default 60 s): the bf16 tests and the stuck-peer test
# share this one set (`agent_pair(default_model, **SMOL_BF16)`).
SMOL_STALL_S = 10
SMOL_BF16: dict[str, Any] = {
    "dtype": "bfloat16",
    "prefill_args": ["--kv-stall-timeout", str(SMOL_STALL_S)],
}


@pytest.fixture(scope="module")
def agent_pair(agent_pool: AgentPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    """Pooled agent sets (or fresh=True ones, stopped when the module ends)."""
    agents = Agents(agent_pool, tmp_path_factory.mktemp("agents"))
    try:
        yield agents
    finally:
        agents.close()


@pytest.fixture
def fresh_agents(agent_pool: AgentPool, tmp_path: Path) -> Iterator[Agents]:
    """Agent sets of this test's own, stopped when it ends: to stop, kill or drain."""
    agents = Agents(agent_pool, tmp_path, fresh=True)
    try:
        yield agents
    finally:
        agents.close()


@pytest.fixture(scope="module")
def smol_set(agent_pool: AgentPool, default_model: Path) -> Iterator[AgentSet]:
    """The default model's pooled set: a prefill and two decode agents (most tests
    use the first decode agent; a two-agent router or gateway uses both). Never
    stopped for memory (the pool pins it); leased per module, so a module finds
    out at its start if an agent of it died."""
    leased = agent_pool.lease(key_for(default_model, n_decode=2))
    try:
        yield leased
    finally:
        agent_pool.release(leased)


@pytest.fixture(scope="module")
def smol_agents(smol_set: AgentSet) -> tuple[AgentProc, AgentProc]:
    return smol_set.pair


Spawn = Callable[..., tuple["subprocess.Popen[str]", Path, str]]


def _spawner(root: Path) -> tuple[Spawn, Callable[[], None]]:
    procs: list[subprocess.Popen[str]] = []
    said: list[str] = []

    def start(role: str, model: Path, **kw: Any) -> tuple[subprocess.Popen[str], Path, str]:
        kw.setdefault("log_dir", root / f"{role}-{len(procs)}")
        proc, log, name = spawn_agent(role, model, **kw)
        procs.append(proc)
        said.append(f"{role} {Path(model).name}")
        return proc, log, name

    def stop() -> None:
        for proc, what in zip(procs, said, strict=True):
            # Exit 1 on its own: the agent refused its start with one line, before
            # torch or mlx loaded (disagg_agents.runtime.args.preflight); no agent came up.
            count_start("refused" if proc.poll() == 1 else "single", what=what)
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()

    return start, stop


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """spawn_agent(role, model, ...) for one agent on its own (stopped when the test
    ends); wait_ready() makes it an AgentProc."""
    start, stop = _spawner(tmp_path)
    try:
        yield start
    finally:
        stop()


@pytest.fixture(scope="module")
def spawn_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawn]:
    """spawn, for a module's fixtures: its agents stop when the module ends."""
    start, stop = _spawner(tmp_path_factory.mktemp("spawned"))
    try:
        yield start
    finally:
        stop()


def ask(
    decode: AgentProc, req: dict[str, Any], *, prefill: AgentProc | None = None, **kw: Any
) -> client.Result:
    """One request to a live decode agent with its token; prefilled by `prefill`
    when given. `kw` goes to the wire client (on_text, on_token, timeout_s...)."""
    if prefill is not None:
        req = {**req, "prefill": {"host": prefill.host, "port": prefill.port}}
    return client.generate(decode.host, decode.port, req, token=decode.token, **kw)


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


def log_since(agent: AgentProc, offset: int) -> str:
    """What the agent logged after byte `offset` of its log (a pooled agent's log
    holds other tests' lines too)."""
    with agent.log_path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def log_size(agent: AgentProc) -> int:
    return agent.log_path.stat().st_size


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


# ---- processes of the control plane ---------------------------------------------------------


def start_serve(
    *args: str, log_path: Path, timeout_s: float = 300, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """`disagg serve --local ARGS` as a real process on a free port, returned once
    it answers there. The caller stops it (SIGTERM stops its agents too). `env` adds
    to the environment (TMPDIR=dir: its agents' logs land in dir/disagg-logs-*)."""
    port = free_port()
    if "--prefix-disk" not in args and "DISAGG_CACHE" not in (env or {}):
        # Its disk tier beside its log, not under the real ~/.cache/disagg (where one
        # run's blocks would answer the next run's prompts).
        args = (*args, "--prefix-disk", str(log_path.parent / f"{log_path.stem}-prefix-disk"))
    cmd = [sys.executable, "-m", "disagg.cli", "serve", "--local", *args, "--port", str(port)]
    count_start("serve", max(1, args.count("-m") + args.count("--model")), what=" ".join(args))
    with log_path.open("wb") as log:
        # Its own process group, as a terminal gives it: a test may signal the group.
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
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
            time.sleep(0.05)


ServeProcess = Callable[..., tuple["subprocess.Popen[bytes]", int]]


@pytest.fixture(scope="session")
def serve_process() -> ServeProcess:
    """start_serve: `disagg serve --local` as a process (the caller stops it)."""
    return start_serve


PythonProcess = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def python_process() -> PythonProcess:
    """`python ARGS` run to its end (capture_output, text): for tests of what a fresh
    interpreter does; `prefix` wraps the command (`unshare ...`). `agents=N` counts
    the agent sets it starts (a `--local` run)."""

    def run(
        *args: str, agents: int = 0, prefix: Sequence[str] = (), **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        count_start("cli", agents)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run([*prefix, sys.executable, *args], **kw)

    return run


@pytest.fixture(scope="session")
def gateways(agent_pool: AgentPool) -> Iterator[Gateways]:
    """In-process gateways over pooled agent sets, keyed by what they serve."""
    started = Gateways(agent_pool.token)
    try:
        yield started
    finally:
        t0 = time.monotonic()
        started.close()
        STOPPED_IN["in-process gateways"] = time.monotonic() - t0


@pytest.fixture(scope="module")
def gateway(
    request: pytest.FixtureRequest,
    gateways: Gateways,
    smol_set: AgentSet,
    agent_pool: AgentPool,
    default_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway | ServeGateway]:
    """The module's gateway over the pooled SmolLM2 set, as its `GATEWAY` (a
    tests.gateways.GatewaySpec) says: the session's shared in-process one unless it
    asks for one of its own or for a `disagg serve` process."""
    spec = getattr(request.module, "GATEWAY", GatewaySpec())
    d = tmp_path_factory.mktemp("gateway")
    with module_gateway(spec, gateways, smol_set, agent_pool.token_file, default_model, d) as gw:
        yield gw


@pytest.fixture(scope="session")
def refs() -> Any:
    """tests.references.References: reference models loaded once per session."""
    from tests.references import References

    return References()


DisaggProcess = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def disagg_process(python_process: PythonProcess) -> DisaggProcess:
    """`disagg ARGS` as a user runs it: a process, where no inventory.toml lies (a
    test must never dial the real cluster), 200 columns wide. `agents=N` counts
    the agent sets a `--local` run starts."""

    def run(
        *args: str, timeout: float = 600, env: dict[str, str] | None = None, agents: int = 0
    ) -> subprocess.CompletedProcess[str]:
        full = {**os.environ, "COLUMNS": "200", **(env or {})}
        full.pop("DISAGG_INVENTORY", None)
        return python_process(
            "-m", "disagg.cli", *args, agents=agents, timeout=timeout, env=full,
            cwd=tempfile.gettempdir(),
        )  # fmt: skip

    return run


# ---- the command line in this process -------------------------------------------------------


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


Cli = Callable[..., CliResult]


def _runner(monkeypatch: pytest.MonkeyPatch, cwd: Path) -> Cli:
    from typer.testing import CliRunner

    from disagg.cli import app, common

    # As a user's 200-column terminal (the consoles read COLUMNS when made), run
    # where no inventory.toml lies: a test must never dial the real cluster.
    monkeypatch.setattr(common.out, "_width", 200)
    monkeypatch.setattr(common.err, "_width", 200)
    monkeypatch.delenv("DISAGG_INVENTORY", raising=False)
    monkeypatch.chdir(cwd)

    def run(*args: str, env: dict[str, str] | None = None) -> CliResult:
        done = CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)
        return CliResult(done.exit_code, done.stdout, done.stderr)

    return run


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Cli]:
    """`disagg ARGS` in this process (typer's CliRunner): exit code, stdout, stderr.
    For runs that start no agent; `cli_local` for `--local` runs."""
    import disagg.api

    def no_agents(*_: Any, **__: Any) -> Any:
        raise AssertionError("this run starts agents: use the cli_local fixture")

    monkeypatch.setattr(disagg.api, "start_local_agents", no_agents)
    yield _runner(monkeypatch, tmp_path)


@pytest.fixture
def cli_local(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, agent_pool: AgentPool
) -> Iterator[Cli]:
    """`disagg ARGS` in this process, its `--local` agents from the pool: the real
    Client.local (model checks, routes) over pooled sets with the pool's token;
    closing the client leaves them running; each run's leases end with it."""
    import disagg.api

    agents = Agents(agent_pool, tmp_path)

    def leased(
        model_dir: Path,
        *,
        n_decode: int = 1,
        dtype: str = "auto",
        prefill_model_dir: Path | None = None,
        decode_args: Sequence[str] = (),
        **_: Any,
    ) -> tuple[AgentProc, list[AgentProc]]:
        got = agent_pool.lease(
            key_for(model_dir, dtype=dtype, n_decode=n_decode, decode_args=decode_args)
        )
        agents.leased.append(got)
        if prefill_model_dir is None:
            return got.prefill, got.decodes
        # Mixed weights: the decode agents of model_dir's set, the prefill agent of
        # prefill_model_dir's (what Client.local starts, from agents already up).
        other = agent_pool.lease_prefill(prefill_model_dir, dtype)
        agents.leased.append(other)
        return other.prefill, got.decodes

    def close(self: Any) -> None:
        self.agents = []

    monkeypatch.setattr(disagg.api, "start_local_agents", leased)
    monkeypatch.setattr(
        disagg.api, "make_token_file", lambda _dir: (agent_pool.token_file, agent_pool.token)
    )
    monkeypatch.setattr(disagg.api.Client, "close", close)
    runner = _runner(monkeypatch, tmp_path)

    def run(*args: str, env: dict[str, str] | None = None) -> CliResult:
        try:
            return runner(*args, env=env)
        finally:  # the run is over, refused or not: the next may lease its sets anew
            for got in list(agents.leased):
                agents.give_back(got)

    try:
        yield run
    finally:
        agents.close()


@pytest.fixture
def pooled_bench_pairs(monkeypatch: pytest.MonkeyPatch, agent_pair: Agents) -> Iterator[None]:
    """The benches' local agent pairs from the pool (they measure agents, not their
    start): `local_pair` and `start_local_pair` hand out a pooled pair of the model,
    and stopping it leaves it running."""
    from contextlib import contextmanager

    import disagg.bench.common
    import disagg.bench.core
    from disagg.serving import localagents

    def pair(model_dir: Path, **_: Any) -> tuple[AgentProc, AgentProc]:
        return agent_pair(Path(model_dir))

    @contextmanager
    def local_pair(model_dir: Path, say: Any) -> Iterator[tuple[AgentProc, AgentProc]]:
        say("starting prefill and decode agents (pooled)")
        yield pair(model_dir)

    for module in (disagg.bench.common, disagg.bench.core):
        monkeypatch.setattr(module, "local_pair", local_pair)
    monkeypatch.setattr(localagents, "start_local_pair", pair)
    monkeypatch.setattr(localagents, "stop_agents", lambda *_a, **_k: None)
    yield

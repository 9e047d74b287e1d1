"""Start agents as local processes and wait until they say READY."""

from __future__ import annotations

import json
import os
import queue
import random
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.errors import AgentError, ModelError
from disagg.serving.control import agent_settings, control_status
from disagg_agents.runtime import lifeline
from disagg_agents.wire.httpauth import control_get


@dataclass
class AgentProc:
    role: str
    proc: subprocess.Popen[str]
    host: str
    port: int
    control_port: int
    name: str
    log_path: Path
    token: bytes | None = None
    _stopped: bool = field(default=False, repr=False)
    # spawn_agent's keywords, to start it again (disagg.serving.supervise)
    spawn: dict[str, Any] = field(default_factory=dict, repr=False)
    started: float = field(default_factory=time.monotonic, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def control(self, path: str, timeout_s: float = 5.0) -> bytes:
        """GET a control endpoint (/health, /status, /metrics), proving our token by
        challenge-response (disagg_agents.wire.httpauth): the token never crosses the wire."""
        return control_get(self.host, self.control_port, path, self.token, timeout_s)

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The agent's /status (device, in flight, counters); OSError or ValueError if not."""
        return control_status(self.host, self.control_port, self.token, timeout_s)

    def settings(self, **changes: Any) -> dict[str, Any]:
        """The agent's live settings, after `changes` (PUT /settings) if any."""
        return agent_settings(self.host, self.control_port, self.token, changes)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        stop_agents([self], grace_s)


def stop_agents(agents: Sequence[AgentProc], grace_s: float = 10.0) -> None:
    """SIGTERM every agent, then wait for them together (each drains, then exits):
    n agents stop in the time of the slowest, not the sum. One still running at
    the shared deadline is killed."""
    todo = [a for a in agents if not a._stopped]
    for agent in todo:
        agent._stopped = True
        if agent.proc.poll() is None:
            agent.proc.terminate()
    deadline = time.monotonic() + grace_s
    for agent in todo:
        try:
            agent.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait()
        if agent.proc.stdout:
            agent.proc.stdout.close()


def _tail(path: Path, n: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def spawn_agent(
    role: str,
    model_dir: Path,
    *,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    device: str = "auto",
    name: str | None = None,
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    module: str | None = None,
) -> tuple[subprocess.Popen[str], Path, str]:
    """Start one agent process; `prefix` wraps the command (e.g. `ip netns exec NS`);
    `module` runs in place of `agents.<role>` (tests wrap an agent to inject faults)."""
    name = name or f"{role}@{host}"
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="disagg-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{role}.log"
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        module or f"disagg_agents.{role}",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--dtype",
        dtype,
        "--device",
        device,
        "--name",
        name,
        *extra_args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(thread_share(role, env))
    env.update(malloc_returns(env))
    if not prefix:
        # Our child: it dies with this process, even a SIGKILLed one (runtime/lifeline.py).
        env[lifeline.ENV] = str(os.getpid())
        if threading.current_thread() is threading.main_thread():
            env[lifeline.ENV_PDEATHSIG] = "1"
    with open(log_path, "ab") as log:
        # A session of its own: a terminal's Ctrl-C goes to the launcher alone, which
        # drains and then stops its agents; taken by the agents too, it ended them
        # mid-drain and the supervisor read that as a crash.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
    return proc, log_path, name


def free_port() -> int:
    """A free port below the OS's ephemeral range: agents a server starts on port 0
    cannot take it before the server binds it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AgentError("no free TCP port on 127.0.0.1 below the ephemeral range")


# disagg_agents.runtime.blasshare.ENV and .torchshare.ENV (not imported: runtime.fastblas
# binds a BLAS on import, runtime.torchshare imports torch).
BLAS_SHARED_ENV = "DISAGG_BLAS_SHARED"
TORCH_SHARED_ENV = "DISAGG_TORCH_SHARED"


def thread_share(role: str, env: dict[str, str]) -> dict[str, str]:
    """Agents started here share this machine's cores, each giving up half of them
    while the other works: the decode agent's OpenBLAS while a prefill for it runs
    (disagg_agents/runtime/blasshare.py), the prefill agent's torch while its requester decodes
    (disagg_agents/runtime/torchshare.py); all of them otherwise. A user's OPENBLAS_NUM_THREADS or
    OMP_NUM_THREADS fixes that agent's count instead. With every core always, each
    stalled the other (16 grader streams on 2 cores: 4x slower decode beside a
    two-thread gemm, TTFT p50 6.6 s and TPOT 0.48 s beside a two-thread prefill
    against 4.0 s and 0.40 s); with half always, one stream alone decoded 1.3x
    slower than mlx-lm (docs/bench-history/2026-11-23-load.md)."""
    half = str(max(1, (os.cpu_count() or 2) // 2))
    # torch's OpenMP threads sleep at a barrier instead of spinning: beside two busy
    # processes on 2 cores a SmolLM2 prefill took 38 s spinning (the default), 1.1 s
    # passive, 2.9 s on one thread (docs/performance.md, 2026-11-27).
    out = {} if "OMP_WAIT_POLICY" in env else {"OMP_WAIT_POLICY": "PASSIVE"}
    if role == "decode" and "OPENBLAS_NUM_THREADS" not in env:
        out[BLAS_SHARED_ENV] = half
    if role == "prefill" and "OMP_NUM_THREADS" not in env:
        out[TORCH_SHARED_ENV] = half
    return out


# glibc's malloc: blocks from 256 KiB up are mapped apart and unmapped when freed, and
# free memory over that at the heap's top goes back. By default glibc raises its
# threshold as big blocks are freed, so a prompt's activations stayed resident after
# it: a SmolLM2 prefill agent held 1.36 GB after one 2.5k-token prompt, 1.14 GB with
# these (the 220 MB cut was freed activations; the rest is torch, the weights and the
# prompt's K/V in the prefix cache). Same prefill time within noise.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "262144"}


def malloc_returns(env: dict[str, str]) -> dict[str, str]:
    """The malloc settings above, where the user set none of their own."""
    if any(k.startswith("MALLOC_") for k in env):
        return {}
    return dict(MALLOC_ENV)


def wait_ready(
    role: str, proc: subprocess.Popen[str], log_path: Path, name: str, timeout_s: float
) -> AgentProc:
    """Read the agent's stdout until READY, FAILED, exit, or timeout."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AgentError(
                f"{role} agent did not start within {timeout_s:.0f}s; "
                f"log {log_path}:\n{_tail(log_path)}"
            ) from None
        if line is None:
            proc.wait()
            raise AgentError(
                f"{role} agent exited with {proc.returncode}; log {log_path}:\n{_tail(log_path)}"
            )
        if line.startswith("FAILED "):
            proc.wait()
            raise ModelError(line[len("FAILED ") :].strip())
        if line.startswith("READY "):
            info = json.loads(line[len("READY ") :])
            return AgentProc(
                role, proc, info["host"], info["port"], info["control_port"], name, log_path
            )


def make_token_file(directory: Path) -> tuple[Path, bytes]:
    """A cluster token for local agents, readable only by us: the one `directory`
    keeps (serve --local's disk tier keys its blocks with it), else a fresh one."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise AgentError(f"{path} is not a token file of ours (0600); remove it") from None
        return path, path.read_bytes().strip()
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path, token.encode()


def start_local_agents(
    model_dir: Path,
    *,
    n_decode: int = 1,
    dtype: str = "auto",
    log_dir: Path | None = None,
    timeout_s: float = 300.0,
    token_file: Path | None = None,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    prefill_model_dir: Path | None = None,
    prefill_module: str | None = None,
    decode_disk: Callable[[str], Sequence[str]] | None = None,
) -> tuple[AgentProc, list[AgentProc]]:
    """Start one prefill and `n_decode` decode agents on 127.0.0.1, all loading at once.

    They share `token_file` (one cluster), or a fresh token of their own;
    `prefill_args` / `decode_args` are extra flags per role (`decode_disk`: by name);
    `prefill_model_dir`: the prefill agent loads that dir instead (mixed weights);
    `prefill_module`: the prefill agent runs from that module (a test's wrapper).
    """
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="disagg-logs-"))
    if token_file is None:
        token_file, token = make_token_file(log_dir)
    else:
        token = token_file.read_bytes().strip()
    names = ["prefill@127.0.0.1"] + [
        "decode@127.0.0.1" if i == 0 else f"decode-{i + 1}@127.0.0.1" for i in range(n_decode)
    ]
    how: list[dict[str, Any]] = [
        dict(
            role="prefill" if i == 0 else "decode",
            model_dir=(prefill_model_dir or model_dir) if i == 0 else model_dir,
            dtype=dtype,
            name=name,
            log_dir=log_dir / name.split("@")[0],
            extra_args=[
                "--token-file",
                str(token_file),
                *(decode_args if i else prefill_args),
                *(decode_disk(name) if i and decode_disk else ()),
            ],
            module=None if i else prefill_module,
        )
        for i, name in enumerate(names)
    ]
    spawned = [spawn_agent(**kw) for kw in how]
    ready: list[AgentProc] = []
    try:
        for i, (proc, log_path, name) in enumerate(spawned):
            ready.append(
                wait_ready("prefill" if i == 0 else "decode", proc, log_path, name, timeout_s)
            )
            ready[-1].token, ready[-1].spawn = token, how[i]
    except BaseException:  # a Ctrl-C while they load, too: they no longer see it
        for proc, _, _ in spawned[len(ready) :]:
            proc.kill()
        stop_agents(ready)
        raise
    return ready[0], ready[1:]


def restart_agent(agent: AgentProc, timeout_s: float = 300.0) -> AgentProc:
    """Start a local agent again as it was started (new ports: the caller updates
    whatever routes to it)."""
    proc, log_path, name = spawn_agent(**agent.spawn)
    try:
        new = wait_ready(agent.role, proc, log_path, name, timeout_s)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    new.token, new.spawn = agent.token, agent.spawn
    return new


def start_local_pair(model_dir: Path, **kw: Any) -> tuple[AgentProc, AgentProc]:
    """Start a prefill and a decode agent on 127.0.0.1; both load at the same time.
    Keywords as for start_local_agents."""
    prefill, decodes = start_local_agents(model_dir, n_decode=1, **kw)
    return prefill, decodes[0]

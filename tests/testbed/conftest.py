"""Fixtures of the four-host test bed (see bed.py): the machines with their sshds,
the models the agents load, a test inventory of the same shape as inventory.toml,
and `fleet_cli` to run the `disagg` fleet commands from the ops namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agentpool import count_start
from tests.conftest import STOPPED_IN
from tests.testbed.bed import BY_NAME, ROOT, TestBed, grant_access, running_testbed

REPO = Path(__file__).resolve().parents[2]
PIPELINES = {"qwen3-coder-30b": ("dgx-spark-1", "mac-studio-2"),
             "gpt-oss-120b": ("dgx-spark-2", "mac-studio-1")}  # fmt: skip


PREFIX_DISK = ['prefix_disk = "kv-blocks"', "prefix_disk_mb = 64"]


def pipeline_cpus() -> dict[str, str]:
    """host -> the CPU its agents are pinned to: one core per pipeline, so the two
    pipelines run side by side like separate machines instead of halving each other's
    speed on the shared cores (mlx decode on CPU takes every core it may)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {
        host: str(cpus[i % len(cpus)])
        for i, hosts in enumerate(PIPELINES.values())
        for host in hosts
    }


@pytest.fixture(scope="session")
def testbed() -> Iterator[TestBed]:
    if os.geteuid() != 0:
        pytest.skip("the test bed needs root: network namespaces, users, sshd")
    t0 = None
    with running_testbed() as bed:
        grant_access(REPO)  # the hosts' users run `python -m disagg_agents.*` from the repo
        yield bed
        t0 = time.monotonic()
    if t0 is not None:
        STOPPED_IN["test bed"] = time.monotonic() - t0


def _share(src: Path, dst: Path) -> Path:
    """Hard-link (or copy) a model dir where the agents' users may read it."""
    dst.mkdir(parents=True, mode=0o755)
    for f in src.iterdir():
        if f.is_file():
            if f.stat().st_mode & 0o004:
                try:
                    os.link(f, dst / f.name)
                    continue
                except OSError:
                    pass
            shutil.copyfile(f, dst / f.name)
            os.chmod(dst / f.name, 0o644)
    return dst


@pytest.fixture(scope="session")
def testbed_models(testbed: TestBed, default_model: Path) -> dict[str, Path]:
    """Both pipelines serve the real SmolLM2, so they do comparable work side by side."""
    smol = _share(default_model, ROOT / "models" / "SmolLM2-135M-Instruct")
    return {pipe: smol for pipe in PIPELINES}


def inventory_text(
    bed: TestBed,
    models: dict[str, Path],
    *,
    dtype: dict[str, str] | None = None,
    key_for: dict[str, Path] | None = None,
    remote_dir: dict[str, str] | None = None,
) -> str:
    """A test inventory like inventory.toml, with the test bed's addresses. Two hosts
    are ssh-config aliases (mac-studio-1 via ProxyJump), two are spelled out. Each
    pipeline's two hosts share one CPU (pipeline_cpus)."""
    dtype = dtype or {}
    cpus = pipeline_cpus()
    key_for = key_for or {}
    remote_dir = remote_dir or {}
    py = sys.executable
    out = [
        "[ssh]",
        f'config = "{bed.ssh_config}"',
        f'known_hosts = "{bed.known_hosts}"',
        "connect_timeout = 5",
        "",
    ]
    for name, m in BY_NAME.items():
        data = f'["{m.link_addr}", "{m.switch_addr}"]'
        role = m.role
        port = 8000 if role == "prefill" else 8001
        out += [f"[hosts.{name}]"]
        if name in ("dgx-spark-1", "mac-studio-1") and name not in key_for:
            out += [f'ssh = "{name}"']
        else:
            key = key_for.get(name, bed.key)
            out += [f'ssh = "{m.switch_addr}"', f'user = "{m.user}"', f'key = "{key}"', "port = 22"]
        out += [
            f"data = {data}",
            f'roles = ["{role}"]',
            f'python = "{py}"',
            f'cpus = "{cpus[name]}"',
            *([f"remote_dir = {json.dumps(remote_dir[name])}"] if name in remote_dir else []),
            f"{role} = {{ port = {port}, control_port = {port + 10} }}",
            "",
        ]
    for pipe, (pre, dec) in PIPELINES.items():
        out += [
            f"[pipelines.{pipe}]",
            f'prefill = ["{pre}"]',
            f'decode = ["{dec}"]',
            f'prefill_model = "{models[pipe]}"',
            f'decode_model = "{models[pipe]}"',
            f'dtype = "{dtype.get(pipe, "auto")}"',
            "prefill_timeout = 60",
            "decode_timeout = 180",
            # One pipeline's decode agent keeps prompt K/V where and as much as the
            # inventory says; the other's takes the defaults.
            *(PREFIX_DISK if pipe == "qwen3-coder-30b" else []),
            "",
        ]
    return "\n".join(out)


@pytest.fixture(scope="session")
def inventory(testbed: TestBed, testbed_models: dict[str, Path]) -> Path:
    path = testbed.ops_dir / "inventory.toml"
    path.write_text(inventory_text(testbed, testbed_models))
    return path


FleetCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def fleet_cli(testbed: TestBed) -> FleetCli:
    """Run `disagg ARGS` in the ops namespace, as a user would."""

    def run(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "disagg.cli", *args]
        proc = testbed.ops(*cmd, timeout=timeout, cwd=REPO)
        sys.stderr.write(
            f"$ disagg {' '.join(args)} -> {proc.returncode}\n"
            f"{proc.stdout[-6000:]}{proc.stderr[-3000:]}"
        )
        count_start("fleet", fleet_starts(args, proc), what=" ".join(args))
        return proc

    return run


def fleet_starts(args: tuple[str, ...], proc: subprocess.CompletedProcess[str]) -> int:
    """Agent starts a fleet command made on the test bed's hosts, in agent sets: a
    whole fleet's start or restart is its two pipelines' sets; one host's, one (an
    agent of a set); a deploy's, one per pipeline whose agents it restarted."""
    if proc.returncode != 0 or not args:
        return 0
    command, rest, hosts = args[0], list(args[1:]), []
    while rest:
        arg = rest.pop(0)
        if arg in ("-i", "--inventory", "--timeout"):
            rest = rest[1:]
        elif not arg.startswith("-"):
            hosts.append(arg)
    if command in ("start", "restart"):
        return len(hosts) if hosts else len(PIPELINES)
    if command == "deploy" and "--json" in args:
        rows = json.loads(proc.stdout)
        restarted = {r["host"] for r in rows if (r.get("result") or {}).get("restarted")}
        return sum(any(h in restarted for h in pair) for pair in PIPELINES.values())
    return 0

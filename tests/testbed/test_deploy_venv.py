"""Deploy's venv and pip-install path on a real test-bed host: a host entry without
`python` gets `<remote_dir>/venv`, made by the host's own `python3 -m venv` over real
ssh, and pip installs the role's requirements into it as the host's user.

The real requirements (torch, transformers, mlx) come from an index the test bed
cannot reach, and from local wheels would take minutes. So the host's pip reads a
wheelhouse of one throwaway wheel built here, through its user's own pip.conf (what
docs/fleet.md tells an air-gapped user to do; this machine's pip config is untouched),
and, where deploy runs in this process, the role's requirement and module lists name
that wheel. The failing case keeps the real lists and the real CLI: the wheelhouse
lacks torch, so pip fails as it would on an offline host without the wheels."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from disagg.fleet import deploy as deploy_mod
from disagg.fleet.inventory import Inventory, load
from disagg.fleet.service import AgentPaths
from disagg.fleet.ssh import connect_host
from tests.testbed.bed import BY_NAME, ROOT, TestBed
from tests.testbed.conftest import FleetCli
from tests.testbed.rig import join_netns

pytestmark = pytest.mark.testbed
T = TypeVar("T")
HOST = "dgx-spark-1"
MACHINE = BY_NAME[HOST]
MODULE = "disagg_venvprobe"  # the throwaway wheel's one module
DIST = f"{MODULE}-1.0"
REQUIREMENT = "disagg-venvprobe==1.0"
WHEELHOUSE = ROOT / "wheelhouse"
PIP_CONF = MACHINE.home / ".config" / "pip" / "pip.conf"
MODEL = ROOT / "models" / "venv-probe"  # deploy checks its config.json; nothing loads it


def build_wheel(dest: Path) -> Path:
    """A pure-Python wheel (PEP 427) written as the zip it is: no build backend needed."""
    files = {
        f"{MODULE}/__init__.py": b'VERSION = "1.0"\n',
        f"{DIST}.dist-info/METADATA": (
            b"Metadata-Version: 2.1\nName: disagg-venvprobe\nVersion: 1.0\n"
        ),
        f"{DIST}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: disagg-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = [
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
        f"{len(b)}"
        for p, b in files.items()
    ]
    path = dest / f"{DIST}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
        z.writestr(f"{DIST}.dist-info/RECORD", "\n".join([*record, f"{DIST}.dist-info/RECORD,,"]))
    return path


@pytest.fixture(scope="module")
def wheelhouse(testbed: TestBed) -> Iterator[Path]:
    """The wheel where the host's user reads it, and that user's pip pointed there
    only: no index (the bed has none), so `pip install --upgrade pip` resolves at once."""
    WHEELHOUSE.mkdir(mode=0o755, exist_ok=True)
    build_wheel(WHEELHOUSE).chmod(0o644)
    MODEL.mkdir(parents=True, mode=0o755, exist_ok=True)
    (MODEL / "config.json").write_text("{}\n")
    for d in (PIP_CONF.parent.parent, PIP_CONF.parent):
        d.mkdir(mode=0o755, exist_ok=True)
        shutil.chown(d, MACHINE.user, MACHINE.user)
    PIP_CONF.write_text(
        f"[global]\nno-index = true\nfind-links = {WHEELHOUSE}\ndisable-pip-version-check = true\n"
    )
    try:
        yield WHEELHOUSE
    finally:
        PIP_CONF.unlink(missing_ok=True)
        shutil.rmtree(WHEELHOUSE, ignore_errors=True)
        for name in (".disagg-venv", ".disagg-venv-fail"):
            shutil.rmtree(MACHINE.home / name, ignore_errors=True)


def venv_inventory(bed: TestBed, remote_dir: str) -> Path:
    """One host, one role (an embedding pipeline has prefill agents only), no `python`:
    deploy prepares the venv. Its own remote_dir and ports, beside the bed's fleet."""
    remote = f"remote_dir = {json.dumps(remote_dir)}"
    text = bed.embedding_inventory(HOST, "venv-probe", str(MODEL), (8004, 8014), remote)
    path = bed.ops_dir / "venv" / f"{remote_dir.strip('~/.')}.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def in_ops(fn: Callable[[], T]) -> T:
    """Run fn in the ops namespace (the operator's laptop: it reaches the hosts)."""
    with ThreadPoolExecutor(1, initializer=join_netns, initargs=("ops",)) as pool:
        return pool.submit(fn).result(timeout=240)


def on_host(inv: Inventory, command: str) -> str:
    with connect_host(inv.hosts[HOST], inv.ssh) as session:
        return session.check(command)


def test_deploy_makes_a_venv_pip_installs_once(
    testbed: TestBed, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deploy_mod, "role_requirements", lambda _role: [REQUIREMENT])
    monkeypatch.setattr(deploy_mod, "role_modules", lambda _role: [MODULE])
    monkeypatch.setenv("DISAGG_TOKEN_FILE", str(testbed.ops_dir / "venv" / "cluster.token"))
    inv = load(str(venv_inventory(testbed, "~/.disagg-venv")))
    said: list[str] = []

    def deploy() -> deploy_mod.HostDeploy:
        [r] = deploy_mod.deploy(inv, [HOST], say=lambda _h, msg: said.append(msg))
        assert r.ok and r.value is not None, r.error
        return r.value

    first = in_ops(deploy)
    root = MACHINE.home / ".disagg-venv"
    python = f"{root}/venv/bin/python"
    assert first.python == python
    assert any(s.startswith(f"preparing {root}/venv") for s in said), said
    # The host's user imports the wheel's module with the venv's python, from the venv.
    where = in_ops(lambda: on_host(inv, f"{python} -c 'import {MODULE}; print({MODULE}.__file__)'"))
    module = Path(where.strip())
    assert module.is_relative_to(root / "venv"), where
    assert module.stat().st_uid == os.stat(MACHINE.home).st_uid  # pip ran as that user
    config = json.loads(Path(AgentPaths(str(root), "prefill").config).read_text())
    assert config["python"] == python  # the agent would run on the venv

    said.clear()
    before = module.stat()
    again = in_ops(deploy)
    assert again.python == python
    assert not [s for s in said if "pip" in s or "preparing" in s], said
    after = module.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_failing_pip_is_one_line_naming_the_host(
    testbed: TestBed, wheelhouse: Path, fleet_cli: FleetCli
) -> None:
    inv = venv_inventory(testbed, "~/.disagg-venv-fail")
    proc = fleet_cli("deploy", HOST, "-i", str(inv), "--json", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    [row] = json.loads(proc.stdout)
    error = row["error"]
    assert not row["ok"] and "\n" not in error, row
    venv = MACHINE.home / ".disagg-venv-fail" / "venv"
    assert error.startswith(f"{HOST}: pip install into {venv} failed: "), error
    # The real prefill requirements: the offline wheelhouse has none of them.
    assert "No matching distribution found for" in error and "fix:" in error, error
    assert (venv / "bin" / "python").is_file()  # the venv itself was made

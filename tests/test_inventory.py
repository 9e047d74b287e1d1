"""Inventory parsing and validation; the shipped inventory.toml validates (never dialled).

Bad inventories are run through the real command (in this process): one red line
naming file and key, exit 1, and nothing dialled (no known_hosts file appears)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.fleet.inventory import DEFAULT_TIMEOUTS_S, InventoryError, load, resolve_path
from tests.conftest import Cli

REPO = Path(__file__).resolve().parents[1]

GOOD = """
[ssh]
config = ""
known_hosts = "{known}"

[hosts.a]
ssh = "10.0.0.1"
data = ["10.1.0.1", "10.0.0.1"]
roles = ["prefill"]

[hosts.b]
ssh = "b-alias"
roles = ["decode", "prefill"]
decode = {{ port = 9001, control_port = 9011 }}

[pipelines.p]
aliases = ["p:1b"]
prefill = ["a"]
decode = ["b"]
prefill_model = "~/m"
decode_model = "~/m-mlx"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.toml"
    path.write_text(text.format(known=tmp_path / "known_hosts"))
    return path


def test_shipped_inventory_validates() -> None:
    inv = load(REPO / "inventory.toml")
    assert list(inv.hosts) == ["dgx-spark-1", "dgx-spark-2", "mac-studio-1", "mac-studio-2"]
    assert inv.hosts["dgx-spark-1"].data == ("192.168.100.1", "169.254.150.103")
    qwen, oss = inv.pipelines["qwen3-coder-30b"], inv.pipelines["gpt-oss-120b"]
    assert (qwen.prefill, qwen.decode) == (("dgx-spark-1",), ("mac-studio-2",))
    assert (oss.prefill, oss.decode) == (("dgx-spark-2",), ("mac-studio-1",))
    assert (qwen.prefill_timeout, qwen.decode_timeout) == (60.0, 180.0)
    assert [a.label for a in inv.agents()] == [
        "dgx-spark-1/prefill",
        "dgx-spark-2/prefill",
        "mac-studio-1/decode",
        "mac-studio-2/decode",
    ]
    assert inv.pipeline_for("qwen3-coder:30b") is qwen


def test_good_inventory_defaults(tmp_path: Path) -> None:
    inv = load(write(tmp_path, GOOD))
    a, b = inv.hosts["a"], inv.hosts["b"]
    assert a.roles["prefill"].port == 8000 and a.roles["prefill"].control_port == 8010
    assert b.roles["decode"].port == 9001
    assert a.addresses() == ["10.1.0.1", "10.0.0.1"]
    assert b.addresses() == []  # an alias is no data-plane address
    assert inv.ssh.config is None
    p = inv.pipelines["p"]
    assert p.prefill_timeout == DEFAULT_TIMEOUTS_S["prefill"] == 60.0
    assert p.decode_timeout == DEFAULT_TIMEOUTS_S["decode"] == 180.0
    # b has a prefill role but no pipeline places a prefill agent there.
    assert [x.label for x in inv.agents()] == ["a/prefill", "b/decode"]
    assert inv.pipeline_for("p:1b") is p
    assert a.cpus is None


@pytest.mark.parametrize("cpus", ["0", "0-3", "0,2,4-7", "1, 3"])
def test_cpu_lists(tmp_path: Path, cpus: str) -> None:
    text = GOOD.replace('roles = ["prefill"]', f'roles = ["prefill"]\ncpus = "{cpus}"')
    assert load(write(tmp_path, text)).hosts["a"].cpus == cpus.replace(" ", "")


def test_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_INVENTORY", raising=False)
    assert resolve_path(None) == Path("inventory.toml")
    monkeypatch.setenv("DISAGG_INVENTORY", str(tmp_path / "env.toml"))
    assert resolve_path(None) == tmp_path / "env.toml"
    assert resolve_path(tmp_path / "opt.toml") == tmp_path / "opt.toml"


BAD = {
    "missing key": (
        lambda s: s.replace('ssh = "10.0.0.1"\n', ""),
        "hosts.a.ssh: missing",
    ),
    "unknown role": (
        lambda s: s.replace('roles = ["prefill"]', 'roles = ["prefil"]'),
        "hosts.a.roles: unknown role 'prefil'",
    ),
    "duplicate port": (
        lambda s: s.replace("port = 9001, control_port = 9011", "port = 8000, control_port = 9011"),
        "hosts.b.prefill.port: port 8000 is also hosts.b.decode.port",
    ),
    "unknown host": (
        lambda s: s.replace('decode = ["b"]', 'decode = ["c"]'),
        "pipelines.p.decode: unknown host 'c'",
    ),
    "unknown key": (
        lambda s: s.replace('ssh = "b-alias"', 'ssh = "b-alias"\nrole = "decode"'),
        "hosts.b.role: unknown key",
    ),
    "bad cpu list": (
        lambda s: s.replace('roles = ["prefill"]', 'roles = ["prefill"]\ncpus = "3-1"'),
        "hosts.a.cpus: not a CPU list: '3-1'",
    ),
    "cpu count, not list": (
        lambda s: s.replace('roles = ["prefill"]', 'roles = ["prefill"]\ncpus = 4'),
        "hosts.a.cpus: expected a CPU list string, got 4",
    ),
    "bad toml": (lambda s: s + "\n[hosts.a\n", "not valid TOML"),
    "negative disk budget": (
        lambda s: s + "prefix_disk_mb = -1\n",
        "pipelines.p.prefix_disk_mb: not a size: -1",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inventory_is_one_clear_line(tmp_path: Path, cli: Cli, case: str) -> None:
    edit, needle = BAD[case]
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(InventoryError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value)
    assert "fix:" in str(info.value) or case == "bad toml"

    proc = cli("deploy", "-i", str(path))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(path) in lines[0] and needle in lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "known_hosts").exists()  # nothing was dialled


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_unreadable_inventory(tmp_path: Path, cli: Cli, kind: str) -> None:
    path = tmp_path / "inv.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage")
    proc = cli("status", "-i", str(path))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(path) in lines[0] and "fix:" in lines[0]


def test_env_var_names_the_file(tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    env_path = tmp_path / "from-env.toml"
    monkeypatch.chdir(REPO)  # where an inventory.toml lies: the variable wins over it
    proc = cli("status", env={"DISAGG_INVENTORY": str(env_path)})
    assert proc.returncode == 1 and str(env_path) in proc.stderr


def decode_script(inv_path: Path) -> list[str]:
    """The run script deploy writes for the inventory's decode agent, as argv."""
    import shlex

    from disagg.fleet import service
    from disagg.fleet.deploy import agent_config

    inv = load(inv_path)
    (agent,) = [a for a in inv.agents() if a.role == "decode"]
    info = service.HostInfo("Darwin", "arm64", "/Users/u", "launchd", "/usr/bin/python3")
    root = "/Users/u/.disagg"
    script = service.run_script(
        service.AgentPaths(root, "decode"), agent_config(agent, info, "py", root)
    )
    (line,) = [ln for ln in script.splitlines() if ln.startswith("exec ")]
    return shlex.split(line)


def test_the_decode_agents_disk_tier_comes_from_the_inventory(tmp_path: Path) -> None:
    """On by default under the host's remote_dir; a pipeline's prefix_disk (~ or
    relative) and prefix_disk_mb reach the run script; 0 turns it off."""
    args = decode_script(write(tmp_path, GOOD))
    assert args[args.index("--prefix-disk") + 1] == "/Users/u/.disagg/prefix-disk"
    assert args[args.index("--prefix-disk-mb") + 1] == "4096"
    args = decode_script(
        write(tmp_path, GOOD + 'prefix_disk = "~/kv cache"\nprefix_disk_mb = 512\n')
    )
    assert args[args.index("--prefix-disk") + 1] == "/Users/u/kv cache"
    assert args[args.index("--prefix-disk-mb") + 1] == "512"
    assert "--prefix-disk" not in decode_script(write(tmp_path, GOOD + "prefix_disk_mb = 0\n"))

"""Fleet edges: known_hosts as OpenSSH reads and writes it, checked against a
real paramiko sshd on port 0; unit and plist text for any path; the run script's
arguments as the agent receives them; pidfiles whose pid was reused never signalled,
run through the same shell text the fleet sends to a host."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import plistlib
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import paramiko
import pytest

from disagg.errors import ConnectError
from disagg.fleet import knownhosts, service
from disagg.fleet.inventory import InventoryError, SshSettings, load
from disagg.fleet.ssh import connect, resolve

# Every character a path may hold that some text here must quote.
HOSTILE_DIR = "dis agg %h %% $HOME ${X} & <b> 'q' \"dq\" back\\slash `t`"


@pytest.fixture(autouse=True)
def no_system_known_hosts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The machine's own /etc/ssh/ssh_known_hosts stays out of these tests."""
    system = tmp_path / "system_known_hosts"
    monkeypatch.setattr(knownhosts, "SYSTEM_FILES", (str(system),))
    return system


# ---- known_hosts against a real sshd ---------------------------------------------------


class _AnyKey(paramiko.ServerInterface):
    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL


@contextmanager
def sshd(host_key: paramiko.PKey) -> Iterator[int]:
    """A paramiko sshd on 127.0.0.1, port 0, presenting `host_key`; yields its port."""
    lsock = socket.create_server(("127.0.0.1", 0))
    transports: list[paramiko.Transport] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            t = paramiko.Transport(conn)
            t.add_server_key(host_key)
            transports.append(t)
            try:
                t.start_server(server=_AnyKey())
            except (paramiko.SSHException, EOFError):
                t.close()  # the client hung up: a refused host key

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield lsock.getsockname()[1]
    finally:
        lsock.close()
        for t in transports:
            t.close()


@pytest.fixture(scope="module")
def host_key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


@pytest.fixture
def client_key(tmp_path: Path) -> Path:
    path = tmp_path / "id_ecdsa"
    paramiko.ECDSAKey.generate().write_private_key_file(str(path))
    return path


def dial(port: int, known: Path, key: Path, config: Path | None = None) -> None:
    settings = SshSettings(config=str(config) if config else None, known_hosts=str(known))
    target = resolve("127.0.0.1", settings, user="u", port=port, key=str(key))
    connect("h1", target, settings).close()


def line(names: str, key: paramiko.PKey, marker: str = "") -> str:
    return f"{marker}{' ' if marker else ''}{names} {key.get_name()} {key.get_base64()}\n"


def test_marker_lines_and_hashed_entries_work(
    tmp_path: Path, host_key: paramiko.PKey, client_key: Path
) -> None:
    other = paramiko.ECDSAKey.generate()
    with sshd(host_key) as port:
        name = f"[127.0.0.1]:{port}"
        known = tmp_path / "known_hosts"
        text = (
            "# comments, markers and junk: none of it may break a connection\n"
            + line("*.example.com", other, "@cert-authority")
            + line("*", other, "@revoked")
            + "@future-marker whatever\n"
            + "garbage\n"
            + "host ssh-ed25519 !!not-base64!!\n"
            + line("|1|c2hvcnQ=|bm8=", other)  # hashed, but a 5-byte salt
            + line(paramiko.HostKeys.hash_host(name), host_key)
        )
        known.write_text(text)
        dial(port, known, client_key)
        assert known.read_text() == text  # known (hashed), so nothing appended


def test_new_key_is_appended_hashed_once(
    tmp_path: Path, host_key: paramiko.PKey, client_key: Path
) -> None:
    known = tmp_path / "sub" / "known_hosts"
    with sshd(host_key) as port:
        dial(port, known, client_key)
        dial(port, known, client_key)
    lines = known.read_text().splitlines()
    assert len(lines) == 1, lines
    hashed, kind, blob = lines[0].split()
    assert (kind, blob) == (host_key.get_name(), host_key.get_base64())
    assert "127.0.0.1" not in lines[0]
    _, one, salt, mac = hashed.split("|")
    assert one == "1" and len(base64.b64decode(salt)) == 20
    # OpenSSH's HashKnownHosts: HMAC-SHA1 keyed by the salt over `[host]:port`.
    want = hmac.new(base64.b64decode(salt), f"[127.0.0.1]:{port}".encode(), hashlib.sha1)
    assert base64.b64decode(mac) == want.digest()


def test_changed_key_refused_with_hint(
    tmp_path: Path, host_key: paramiko.PKey, client_key: Path
) -> None:
    known = tmp_path / "known_hosts"
    with sshd(host_key) as port:
        text = line(f"[127.0.0.1]:{port}", paramiko.ECDSAKey.generate())
        known.write_text(text)
        with pytest.raises(ConnectError, match="CHANGED") as e:
            dial(port, known, client_key)
    assert f"ssh-keygen -R '[127.0.0.1]:{port}' -f {known}" in str(e.value)
    assert known.read_text() == text


@pytest.mark.parametrize("also_known", [False, True], ids=["unknown", "also-listed-as-known"])
def test_revoked_host_key_is_refused(
    tmp_path: Path, host_key: paramiko.PKey, client_key: Path, also_known: bool
) -> None:
    known = tmp_path / "known_hosts"
    with sshd(host_key) as port:
        text = line("*", host_key, "@revoked")
        if also_known:
            text += line(paramiko.HostKeys.hash_host(f"[127.0.0.1]:{port}"), host_key)
        known.write_text(text)
        with pytest.raises(ConnectError, match="REVOKED") as e:
            dial(port, known, client_key)
    assert str(known) in str(e.value)
    assert known.read_text() == text  # never appended


def test_system_and_ssh_config_files_are_read(
    tmp_path: Path,
    host_key: paramiko.PKey,
    client_key: Path,
    no_system_known_hosts: Path,
) -> None:
    user = tmp_path / "known_hosts"
    with sshd(host_key) as port:
        name = f"[127.0.0.1]:{port}"
        # The system file (no ssh_config): its key counts, nothing is appended.
        no_system_known_hosts.write_text(line(name, host_key))
        dial(port, user, client_key)
        assert not user.exists()
        # ssh_config's files: UserKnownHostsFile (two of them) and GlobalKnownHostsFile,
        # which replaces the system file: a changed key there is refused.
        cfg_user, cfg_global = tmp_path / "cfg user", tmp_path / "cfg_global"
        cfg_user.write_text(line(paramiko.HostKeys.hash_host(name), host_key))
        config = tmp_path / "ssh_config"
        config.write_text(
            "Host 127.0.0.1\n"
            f'  UserKnownHostsFile {tmp_path}/none-such "{cfg_user}"\n'
            f"  GlobalKnownHostsFile {cfg_global}\n"
        )
        no_system_known_hosts.write_text("")
        dial(port, user, client_key, config)
        assert not user.exists()
        cfg_user.unlink()
        cfg_global.write_text(line(name, paramiko.ECDSAKey.generate()))
        no_system_known_hosts.write_text(line(name, host_key))  # ignored now
        with pytest.raises(ConnectError, match="CHANGED") as e:
            dial(port, user, client_key, config)
        assert f"-f {cfg_global}" in str(e.value)


def test_known_hosts_patterns() -> None:
    key = paramiko.ECDSAKey.generate()
    known = knownhosts.parse(
        line("*.lan,!bad.lan", key)
        + line("[10.0.0.?]:2222", key)
        + line(paramiko.HostKeys.hash_host("hashed.example"), key)
    )
    assert knownhosts.matches(known.entries[0].patterns, "Mac.LAN")
    assert not knownhosts.matches(known.entries[0].patterns, "bad.lan")
    assert knownhosts.matches(known.entries[1].patterns, "[10.0.0.7]:2222")
    assert not knownhosts.matches(known.entries[1].patterns, "10.0.0.7")
    assert not knownhosts.matches(known.entries[1].patterns, "[10.0.0.77]:2222")
    assert len(known.lookup("Hashed.Example")) == 1


# ---- unit, plist and run script text for any path -----------------------------------------


def test_systemd_exec_start_quotes_any_path() -> None:
    paths = service.AgentPaths(f"/home/u/{HOSTILE_DIR}", "decode")
    unit = service.systemd_unit(paths)
    exec_start = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    value = exec_start[len("ExecStart=") :]
    # systemd: specifiers (%%) and variables ($$) first, then C-style quoted words.
    assert "%h" not in value.replace("%%", "") and "${X}" not in value.replace("$$", "")
    words = shlex.split(value.replace("%%", "\0").replace("$$", "$").replace("\0", "%"))
    assert words == ["/bin/sh", paths.script]


def test_launchd_plist_escapes_any_path() -> None:
    paths = service.AgentPaths(f"/Users/u/{HOSTILE_DIR}", "prefill")
    plist = plistlib.loads(service.launchd_plist(paths).encode())
    assert plist["ProgramArguments"] == ["/bin/sh", paths.script]
    assert plist["Label"] == "com.disagg.prefill"


def test_remote_dir_with_a_newline_is_one_clear_error(tmp_path: Path) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text(
        '[ssh]\nconfig = ""\n[hosts.a]\nssh = "10.0.0.1"\nroles = ["prefill"]\n'
        'remote_dir = "~/x\\ny"\n'
        '[pipelines.p]\nprefill = ["a"]\ndecode = ["a"]\nprefill_model = "m"\ndecode_model = "m"\n'
    )
    with pytest.raises(InventoryError) as e:
        load(inv)
    msg = str(e.value)
    assert "hosts.a.remote_dir" in msg and "newline" in msg and "\n" not in msg


def agent_root(tmp_path: Path) -> Path:
    root = tmp_path / HOSTILE_DIR
    (root / "run").mkdir(parents=True)
    (root / "logs").mkdir()
    return root


def test_run_script_passes_paths_and_log_file_intact(tmp_path: Path) -> None:
    root = agent_root(tmp_path)
    fake_python = tmp_path / "fake python"
    # Records the arguments it got, NUL-separated, where the test can read them.
    fake_python.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {shlex.quote(str(root))}/args\n")
    fake_python.chmod(0o755)
    paths = service.AgentPaths(str(root), "prefill")
    config: dict[str, Any] = {
        "python": str(fake_python),
        "model": f"{root}/model",
        "bind": "127.0.0.1",
        "port": 8000,
        "control_port": 8010,
        "name": "prefill@a",
        "dtype": "auto",
        "token_file": f"{root}/token",
    }
    Path(paths.script).write_text(service.run_script(paths, config))
    subprocess.run(["/bin/sh", paths.script], check=True, timeout=30)
    args = (root / "args").read_bytes().decode().split("\0")[:-1]
    assert args[:2] == ["-m", "disagg_agents.prefill"]
    assert args[args.index("--model") + 1] == f"{root}/model"
    assert args[args.index("--token-file") + 1] == f"{root}/token"
    assert args[args.index("--log-file") + 1] == paths.log == f"{root}/logs/prefill.log"
    assert Path(paths.stderr).exists() and paths.stderr != paths.log
    assert Path(paths.pid).read_text().strip().isdigit()


# ---- pidfiles ----------------------------------------------------------------------------


def sh(command: str, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The shell text the fleet sends to a host, run here the same way (sh -c); `path`
    goes first on PATH."""
    env = dict(os.environ)
    if path:
        env["PATH"] = f"{path}:{env['PATH']}"
    return subprocess.run(
        ["/bin/sh", "-c", command], capture_output=True, text=True, timeout=60, env=env
    )


@contextmanager
def process(*argv: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv)
    # Reaped as soon as it exits: a zombie would still answer kill -0.
    reaper = threading.Thread(target=proc.wait, daemon=True)
    reaper.start()
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        reaper.join(10)


@pytest.mark.parametrize("kind", ["nohup", "systemd", "launchd"])
def test_reused_pid_is_never_signalled(tmp_path: Path, kind: str) -> None:
    paths = service.AgentPaths(str(agent_root(tmp_path)), "prefill")
    # This machine's own service manager is never asked to stop anything.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for tool in ("systemctl", "launchctl"):
        (fake_bin / tool).write_text("#!/bin/sh\nexit 1\n")
        (fake_bin / tool).chmod(0o755)
    with process("sleep", "60") as stranger:
        Path(paths.pid).write_text(f"{stranger.pid}\n")
        assert sh(service.is_running(paths)).returncode == 1
        assert not Path(paths.pid).exists()  # stale: removed
        Path(paths.pid).write_text(f"{stranger.pid}\n")
        # stop's first step (systemctl / launchctl) fails, as when the unit is not loaded.
        assert sh(service.stop(kind, paths, grace_s=1), fake_bin).returncode == 0
        time.sleep(0.2)
        assert stranger.poll() is None, "an unrelated process was signalled"
        assert not Path(paths.pid).exists()


@pytest.mark.slow  # starts a Python (one that sleeps, as an agent's stand-in)
def test_pid_of_the_agent_is_stopped(tmp_path: Path) -> None:
    paths = service.AgentPaths(str(agent_root(tmp_path)), "decode")
    code = "import time; time.sleep(60)"
    # Looks like the agent: names its module and its root, as the run script's exec does.
    with process(
        sys.executable, "-c", code, "disagg_agents.decode", "--token-file", f"{paths.root}/token"
    ) as agent:
        Path(paths.pid).write_text(f"{agent.pid}\n")
        res = sh(f"{service.is_running(paths)} && echo $pid")
        assert res.returncode == 0 and res.stdout.split() == [str(agent.pid)]
        # The same module under another root is somebody else's agent.
        other = service.AgentPaths(paths.root + "-other", "decode")
        Path(other.pid).parent.mkdir(parents=True)
        Path(other.pid).write_text(f"{agent.pid}\n")
        assert sh(service.is_running(other)).returncode == 1
        assert sh(service.stop("nohup", paths, grace_s=5)).returncode == 0
        assert agent.wait(30) == -15  # SIGTERM ended it; after the grace it would be -9
    assert not Path(paths.pid).exists()


def test_pid_of_the_run_script_before_exec_counts(tmp_path: Path) -> None:
    paths = service.AgentPaths(str(agent_root(tmp_path)), "prefill")
    Path(paths.script).write_text("while :; do sleep 0.2; done\n")
    with process("/bin/sh", paths.script) as script:
        Path(paths.pid).write_text(f"{script.pid}\n")
        assert sh(service.is_running(paths)).returncode == 0

"""Four machines on one: network namespaces with their own users and OpenSSH servers.

  switch, 1 Gbit/s (bridge br0 in its own namespace), 10.77.0.0/24:
      ops .2   dgx-spark-1 .11   dgx-spark-2 .12   mac-studio-1 .21   mac-studio-2 .22
  fast data links, 10 Gbit/s:
      dgx-spark-1 10.78.1.1 <-> mac-studio-2 10.78.1.2   (qwen pipeline)
      dgx-spark-2 10.78.2.1 <-> mac-studio-1 10.78.2.2   (gpt-oss pipeline)

No namespace has a default route: every packet stays inside the test bed. Each host
runs `sshd -D` from Debian's openssh-server with a generated host key, key auth
only, for its own user (tb-<host>) whose home is under ROOT. Needs root.

The hosts share this machine's filesystem: agents run the current venv's python as
their users, so `grant_access` gives others execute (traverse) permission on the
directories leading to it (e.g. /root for a pyenv python), restored at teardown.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/tmp/disagg-testbed")  # fixed, so leftovers of a crashed run are found
STATE = Path("/tmp/disagg-testbed.state.json")
LOCK = Path("/tmp/disagg-testbed.lock")
SWITCH = "switch"
OPS = "ops"
SWITCH_RATE = "1gbit"
FAST_RATE = "10gbit"
OPS_ADDR = "10.77.0.2"
SETUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Machine:
    name: str  # namespace and inventory name
    switch_addr: str
    link: int  # which fast data link it is on
    link_addr: str
    role: str

    @property
    def user(self) -> str:
        return f"tb-{self.name}"

    @property
    def home(self) -> Path:
        return ROOT / "home" / self.user

    @property
    def dir(self) -> Path:
        return ROOT / "hosts" / self.name


MACHINES = (
    Machine("dgx-spark-1", "10.77.0.11", 1, "10.78.1.1", "prefill"),
    Machine("dgx-spark-2", "10.77.0.12", 2, "10.78.2.1", "prefill"),
    Machine("mac-studio-1", "10.77.0.21", 2, "10.78.2.2", "decode"),
    Machine("mac-studio-2", "10.77.0.22", 1, "10.78.1.2", "decode"),
)
BY_NAME = {m.name: m for m in MACHINES}
NAMESPACES = (SWITCH, OPS, *(m.name for m in MACHINES))


class TestBedError(RuntimeError):
    pass


def sh(*cmd: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestBedError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def in_ns(
    ns: str, *cmd: str, timeout: float = 30.0, check: bool = True
) -> subprocess.CompletedProcess[str]:  # noqa: E501
    return sh("ip", "netns", "exec", ns, *cmd, timeout=timeout, check=check)


def missing_tools() -> list[str]:
    return [
        t for t in ("ip", "tc", "useradd", "ssh-keygen", "/usr/sbin/sshd") if not shutil.which(t)
    ]


def ensure_tools() -> None:
    """Install Debian's openssh-server and iproute2 if missing (CI's .ci/run does too)."""
    if not missing_tools():
        return
    sh("apt-get", "update", "-qq", timeout=300)
    sh("apt-get", "install", "-y", "-qq", "openssh-server", "iproute2", timeout=600)
    if missing_tools():
        raise TestBedError(f"still missing after apt-get: {missing_tools()}")


# ---- cleanup ----------------------------------------------------------------------------


def _kill_namespace_pids(ns: str) -> None:
    pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                return
            time.sleep(0.1)


def cleanup() -> None:
    """Remove everything a test bed (this one or a crashed one) left. Idempotent."""
    state = json.loads(STATE.read_text()) if STATE.is_file() else {}
    existing = set(sh("ip", "netns", "list", check=False).stdout.split())
    for ns in NAMESPACES:
        if ns in existing:
            _kill_namespace_pids(ns)
            sh("ip", "netns", "del", ns, check=False)
    for m in MACHINES:
        if sh("id", "-u", m.user, check=False).returncode == 0:
            sh("pkill", "-KILL", "-u", m.user, check=False)  # only the test bed's own users
            sh("userdel", m.user, check=False)
    for path, mode in state.get("chmod", {}).items():
        with contextlib.suppress(OSError):
            os.chmod(path, int(mode))
    shutil.rmtree(ROOT, ignore_errors=True)
    STATE.unlink(missing_ok=True)


# ---- setup ------------------------------------------------------------------------------


def _record(key: str, value: object) -> None:
    state = json.loads(STATE.read_text()) if STATE.is_file() else {}
    if isinstance(value, dict):
        state.setdefault(key, {}).update(value)
    else:
        state[key] = value
    STATE.write_text(json.dumps(state))


def grant_access(path: Path) -> None:
    """Let other users traverse every directory leading to `path` (o+x only)."""
    changed: dict[str, int] = {}
    for d in [*reversed(Path(os.path.realpath(path)).parents), Path(os.path.realpath(path))]:
        if not d.is_dir():
            continue
        mode = d.stat().st_mode & 0o7777
        if not mode & 0o001:
            changed[str(d)] = mode
            os.chmod(d, mode | 0o001)
    if changed:
        state = json.loads(STATE.read_text()) if STATE.is_file() else {}
        old = state.get("chmod", {})
        _record("chmod", {k: v for k, v in changed.items() if k not in old})


def _network() -> None:
    for ns in NAMESPACES:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", SWITCH, "link", "set", "br0", "up")
    ports = [(OPS, OPS_ADDR, "p-ops")] + [(m.name, m.switch_addr, f"p-{m.name}") for m in MACHINES]
    for ns, addr, port in ports:
        port = port[:15]
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
           "netns", SWITCH)  # fmt: skip
        sh("ip", "-n", SWITCH, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        for where, dev in ((ns, "eth0"), (SWITCH, port)):
            sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", SWITCH_RATE,
               "burst", "256kb", "latency", "50ms")  # fmt: skip
    for link in (1, 2):
        a, b = [m for m in MACHINES if m.link == link]
        sh("ip", "link", "add", "fast0", "netns", a.name, "type", "veth", "peer", "name", "fast0",
           "netns", b.name)  # fmt: skip
        for m in (a, b):
            sh("ip", "-n", m.name, "addr", "add", f"{m.link_addr}/24", "dev", "fast0")
            sh("ip", "-n", m.name, "link", "set", "fast0", "up")
            sh("tc", "-n", m.name, "qdisc", "add", "dev", "fast0", "root", "tbf", "rate",
               FAST_RATE, "burst", "2mb", "latency", "50ms")  # fmt: skip


def _keygen(path: Path, comment: str) -> None:
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


SSHD_CONFIG = """\
Port 22
ListenAddress 0.0.0.0
HostKey {dir}/ssh_host_ed25519_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin no
AllowUsers {user}
StrictModes yes
AllowTcpForwarding yes
MaxStartups 100
MaxSessions 100
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""


def _user(m: Machine, pubkey: str) -> None:
    sh("useradd", "-M", "-d", str(m.home), "-s", "/bin/sh", m.user)
    sh("usermod", "-p", "*", m.user)  # no password, yet not "locked" for sshd
    ssh_dir = m.home / ".ssh"
    ssh_dir.mkdir(parents=True)
    (ssh_dir / "authorized_keys").write_text(pubkey)
    sh("chown", "-R", f"{m.user}:{m.user}", str(m.home))
    os.chmod(m.home, 0o700)
    os.chmod(ssh_dir, 0o700)
    os.chmod(ssh_dir / "authorized_keys", 0o600)


class TestBed:
    """The running test bed: machines, keys, sshds; what tests need to drive it."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self) -> None:
        self.root = ROOT
        self.ops_dir = ROOT / "ops"
        self.key = self.ops_dir / "id_ed25519"
        self.wrong_key = self.ops_dir / "wrong_ed25519"
        self.ssh_config = self.ops_dir / "ssh_config"
        self.known_hosts = self.ops_dir / "known_hosts"
        self.sshd: dict[str, subprocess.Popen[bytes]] = {}

    def embedding_inventory(
        self, host: str, pipeline: str, model: str, ports: tuple[int, int], *host_lines: str
    ) -> str:
        """An inventory of one host serving one embedding pipeline (prefill agents
        only), on its own ports; `host_lines` add to (or set) the host's entry."""
        m = BY_NAME[host]
        return "\n".join(
            [
                "[ssh]",
                f'config = "{self.ssh_config}"',
                f'known_hosts = "{self.known_hosts}"',
                "connect_timeout = 5",
                "",
                f"[hosts.{host}]",
                f'ssh = "{host}"',
                f'data = ["{m.link_addr}", "{m.switch_addr}"]',
                'roles = ["prefill"]',
                *host_lines,
                f"prefill = {{ port = {ports[0]}, control_port = {ports[1]} }}",
                "",
                f"[pipelines.{pipeline}]",
                f'prefill = ["{host}"]',
                f'embedding_model = "{model}"',
                "",
            ]
        )

    def start(self) -> None:
        t0 = time.monotonic()
        cleanup()
        STATE.write_text("{}")
        ROOT.mkdir(mode=0o755)
        os.chmod(ROOT, 0o755)
        for d in (self.ops_dir, ROOT / "home", ROOT / "hosts", ROOT / "models"):
            d.mkdir(mode=0o755)
        _keygen(self.key, "ops@testbed")
        _keygen(self.wrong_key, "stranger@testbed")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        _network()
        pub = self.key.with_suffix(".pub").read_text()
        for m in MACHINES:
            _user(m, pub)
            m.dir.mkdir(mode=0o700)
            sh(
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-f",
                str(m.dir / "ssh_host_ed25519_key"),
            )
            (m.dir / "sshd_config").write_text(SSHD_CONFIG.format(dir=m.dir, user=m.user))
            sh("/usr/sbin/sshd", "-t", "-f", str(m.dir / "sshd_config"))
            self.start_sshd(m.name)
        self.write_ssh_config()
        if time.monotonic() - t0 > SETUP_TIMEOUT_S:
            raise TestBedError(f"test bed setup took {time.monotonic() - t0:.0f}s")

    def start_sshd(self, name: str, timeout_s: float = 15.0) -> None:
        m = BY_NAME[name]
        log = m.dir / "sshd.log"
        log.write_text("")
        self.sshd[name] = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                name,
                "/usr/sbin/sshd",
                "-D",
                "-e",
                "-f",
                str(m.dir / "sshd_config"),
            ],  # noqa: E501
            stdout=subprocess.DEVNULL,
            stderr=open(log, "ab"),  # noqa: SIM115 (the child owns it)
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while "Server listening on 0.0.0.0" not in log.read_text():
            if self.sshd[name].poll() is not None or time.monotonic() > deadline:
                raise TestBedError(f"sshd on {name} did not start: {log.read_text()[-500:]}")
            time.sleep(0.05)

    def stop_sshd(self, name: str) -> None:
        proc = self.sshd.pop(name, None)
        if proc and proc.poll() is None:
            proc.terminate()
            proc.wait(10)

    def write_ssh_config(self) -> None:
        """Aliases for two hosts; mac-studio-1 only through ProxyJump dgx-spark-2 over
        their fast link (ops has no route to it)."""
        s1, s2, m1 = BY_NAME["dgx-spark-1"], BY_NAME["dgx-spark-2"], BY_NAME["mac-studio-1"]
        self.ssh_config.write_text(
            f"Host dgx-spark-1\n  HostName {s1.switch_addr}\n  User {s1.user}\n"
            f"  IdentityFile {self.key}\n\n"
            f"Host spark2-jump\n  HostName {s2.switch_addr}\n  User {s2.user}\n"
            f"  IdentityFile {self.key}\n\n"
            f"Host mac-studio-1\n  HostName {m1.link_addr}\n  User {m1.user}\n"
            f"  IdentityFile {self.key}\n  ProxyJump spark2-jump\n"
        )

    def link(self, number: int, up: bool) -> None:
        """Bring a fast data link down or up (both ends; addresses and routes come back)."""
        for m in MACHINES:
            if m.link == number:
                sh("ip", "-n", m.name, "link", "set", "fast0", "up" if up else "down")

    def ops(
        self, *cmd: str, timeout: float = 300.0, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:  # noqa: E501
        """Run a command in the ops namespace (the operator's laptop)."""
        return subprocess.run(
            ["ip", "netns", "exec", OPS, *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            # Wide enough for the tables; the operator's cluster token lives with ops.
            env={
                **os.environ,
                "COLUMNS": "200",
                "DISAGG_TOKEN_FILE": str(self.ops_dir / "cluster.token"),
            },
        )

    def stop(self) -> None:
        for name in list(self.sshd):
            self.stop_sshd(name)
        cleanup()


@contextlib.contextmanager
def running_testbed() -> Iterator[TestBed]:
    """Start the test bed (one at a time on this machine), tear it down at the end."""
    if os.geteuid() != 0:
        raise TestBedError("the test bed needs root (network namespaces, users, sshd)")
    ensure_tools()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        bed = TestBed()
        try:
            bed.start()
            grant_access(Path(sys.executable))
            grant_access(Path(sys.prefix))
            yield bed
        finally:
            bed.stop()

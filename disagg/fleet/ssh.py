"""SSH to the fleet's hosts with paramiko: key auth, ~/.ssh/config aliases and
ProxyJump, host keys checked accept-new style against every known_hosts file
OpenSSH would read (knownhosts.py), errors that say what to do.

`on_hosts` runs a function on every host at once and returns per-host results.
"""

from __future__ import annotations

import getpass
import logging
import shlex
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import paramiko

from disagg.errors import AgentError, ConnectError, DisaggError
from disagg.fleet import knownhosts
from disagg.fleet.inventory import Host, SshSettings

T = TypeVar("T")
# paramiko logs failures we already turn into errors; keep it off the user's stderr.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to connect, after ssh config and inventory are combined."""

    label: str  # what the user calls it: the inventory host or alias
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    jump: SshTarget | None = None
    # ssh_config's UserKnownHostsFile / GlobalKnownHostsFile for this host, when set.
    known_hosts_config: tuple[tuple[str, str], ...] = ()

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def _ssh_config(settings: SshSettings) -> paramiko.SSHConfig | None:
    if not settings.config:
        return None
    path = Path(settings.config).expanduser()
    return paramiko.SSHConfig.from_path(str(path)) if path.is_file() else None


def _parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` (each part but host optional) -> (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, _, port = rest.partition(":")
    return (user or None, host, int(port) if port else None)


def resolve(
    label: str,
    settings: SshSettings,
    *,
    user: str | None = None,
    port: int | None = None,
    key: str | None = None,
    proxy_jump: str | None = None,
    _depth: int = 0,
) -> SshTarget:
    """Combine explicit settings (which win) with the ssh config entry for `label`."""
    if _depth > 4:
        raise ConnectError(f"ProxyJump chain through {label} is too deep (or loops)")
    cfg = _ssh_config(settings)
    entry: dict[str, Any] = dict(cfg.lookup(label)) if cfg else {}
    keys = (key,) if key else tuple(entry.get("identityfile") or ())
    jump_spec = proxy_jump or entry.get("proxyjump")
    jump = None
    if jump_spec and jump_spec.lower() != "none":
        # A chain "a,b" reaches b through a: the last hop is our direct jump.
        *before, last = [s.strip() for s in jump_spec.split(",")]
        j_user, j_host, j_port = _parse_jump(last)
        jump = resolve(
            j_host,
            settings,
            user=j_user,
            port=j_port,
            proxy_jump=",".join(before) or None,
            _depth=_depth + 1,
        )
    return SshTarget(
        label=label,
        hostname=str(entry.get("hostname") or label),
        port=int(port or entry.get("port") or 22),
        user=str(user or entry.get("user") or getpass.getuser()),
        key_files=tuple(str(Path(k).expanduser()) for k in keys),
        jump=jump,
        known_hosts_config=tuple(
            (k, str(entry[k])) for k in ("userknownhostsfile", "globalknownhostsfile") if k in entry
        ),
    )


def target_for(host: Host, settings: SshSettings) -> SshTarget:
    return resolve(
        host.ssh,
        settings,
        user=host.user,
        port=host.port,
        key=host.key,
        proxy_jump=host.proxy_jump,
    )


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Like OpenSSH's StrictHostKeyChecking=accept-new: remember keys never seen (hashed,
    in the inventory's known_hosts); never a revoked one. paramiko refuses a changed key
    before asking this policy."""

    def __init__(self, name: str, known: knownhosts.KnownHosts, write_to: Path) -> None:
        self.name, self.known, self.write_to = name, known, write_to

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        revoked = self.known.revoked_key(key)
        if revoked is not None:
            raise ConnectError(_revoked_message(self.name, hostname, revoked))
        client.get_host_keys().add(hostname, key.get_name(), key)
        knownhosts.append(self.write_to, hostname, key)


def _revoked_message(name: str, hostname: str, entry: knownhosts.Entry) -> str:
    return (
        f"{name}: host key of {hostname} is REVOKED (@revoked in {entry.path}); refusing to "
        "connect: the host must get a new host key (ssh-keygen -A there), then connect again"
    )


@dataclass
class Output:
    rc: int
    out: str
    err: str


class Session:
    """One open SSH connection (plus its jump hosts) to one inventory host."""

    def __init__(self, name: str, target: SshTarget, clients: list[paramiko.SSHClient]) -> None:
        self.name = name
        self.target = target
        self._clients = clients  # the last one is this host; the others are jumps
        self._sftp: paramiko.SFTPClient | None = None

    @property
    def client(self) -> paramiko.SSHClient:
        return self._clients[-1]

    def run(self, command: str, timeout_s: float = 60.0, stdin: str | None = None) -> Output:
        """Run `command` in the host's shell and wait for it."""
        try:
            chan_in, chan_out, chan_err = self.client.exec_command(command, timeout=timeout_s)
            if stdin is not None:
                chan_in.write(stdin)
            chan_in.channel.shutdown_write()
            out = chan_out.read().decode(errors="replace")
            err = chan_err.read().decode(errors="replace")
            rc = chan_out.channel.recv_exit_status()
        except TimeoutError:
            raise AgentError(
                f"{self.name}: command did not finish within {timeout_s:.0f}s: {command[:80]}"
            ) from None
        except (paramiko.SSHException, OSError) as e:
            raise ConnectError(f"{self.name}: ssh connection lost: {e}") from None
        return Output(rc, out, err)

    def check(self, command: str, timeout_s: float = 60.0, stdin: str | None = None) -> str:
        """Run `command`; its stdout, or AgentError with the last line of its stderr."""
        res = self.run(command, timeout_s, stdin)
        if res.rc != 0:
            lines = (res.err or res.out).strip().splitlines()
            why = lines[-1] if lines else f"exit status {res.rc}"
            raise AgentError(f"{self.name}: remote command failed: {why}")
        return res.out

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self.client.open_sftp()
        return self._sftp

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        for c in reversed(self._clients):
            c.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _open(
    name: str, t: SshTarget, settings: SshSettings, sock: Any, known_file: Path
) -> paramiko.SSHClient:
    known = knownhosts.load(knownhosts.files(known_file, dict(t.known_hosts_config)))
    entry = t.hostname if t.port == 22 else f"[{t.hostname}]:{t.port}"  # as paramiko names it
    client = paramiko.SSHClient()
    known.add_to(client.get_host_keys(), entry)
    client.set_missing_host_key_policy(_AcceptNew(name, known, known_file))
    keys = _present_keys(name, t)
    try:
        client.connect(
            t.hostname,
            port=t.port,
            username=t.user,
            key_filename=keys or None,
            # With an explicit key, use only it: never fall back to other keys or passwords.
            allow_agent=not keys,
            look_for_keys=not keys,
            timeout=settings.connect_timeout,
            banner_timeout=settings.connect_timeout,
            auth_timeout=settings.connect_timeout,
            sock=sock,
        )
    except paramiko.BadHostKeyException as e:
        client.close()
        raise _bad_host_key(name, t, entry, known, known_file, e.key) from None
    except DisaggError:  # from the policy: a revoked key
        client.close()
        raise
    except paramiko.AuthenticationException:
        client.close()
        how = f"key {', '.join(keys)}" if keys else "ssh-agent / default keys"
        raise ConnectError(
            f"{name}: authentication refused for {t.where} with {how}; fix: install the public "
            f"key there (ssh-copy-id -i KEY.pub -p {t.port} {t.user}@{t.hostname}) or fix "
            "the inventory's user/key"
        ) from None
    except TimeoutError:
        client.close()
        raise ConnectError(
            f"{name}: {t.where} unreachable: timed out after {settings.connect_timeout:.0f}s; "
            "check the address, the network and that the host is up"
        ) from None
    except (paramiko.SSHException, OSError) as e:
        client.close()
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConnectError(
            f"{name}: {t.where} unreachable: {why}; check the address, the ssh port and "
            "that sshd runs there"
        ) from None
    return client


def _present_keys(name: str, t: SshTarget) -> list[str]:
    """The target's key files that exist; none of several found is one line."""
    missing = [k for k in t.key_files if not Path(k).is_file()]
    if missing and len(missing) == len(t.key_files):
        raise ConnectError(
            f"{name}: ssh key {missing[0]} not found; fix: create it (ssh-keygen -t ed25519) "
            "or point the inventory's key at an existing one"
        )
    return [k for k in t.key_files if k not in missing]


def _bad_host_key(
    name: str,
    t: SshTarget,
    entry: str,
    known: knownhosts.KnownHosts,
    known_file: Path,
    key: paramiko.PKey,
) -> ConnectError:
    """A host key other than the one held: revoked, or changed (and how to clear it)."""
    revoked = known.revoked_key(key)
    if revoked is not None:
        return ConnectError(_revoked_message(name, entry, revoked))
    held = known.lookup(entry)
    where = held[0].path if held else str(known_file)
    return ConnectError(
        f"{name}: host key of {t.hostname} CHANGED (not the one in {where}); if the host "
        f"was reinstalled, remove the old key: ssh-keygen -R {q(entry)} -f {q(where)}"
    )


def connect(name: str, target: SshTarget, settings: SshSettings) -> Session:
    """Open an SSH session to `target`, through its jump hosts if any."""
    known_file = Path(settings.known_hosts).expanduser()
    hops: list[SshTarget] = []
    t: SshTarget | None = target
    while t is not None:
        hops.insert(0, t)
        t = t.jump
    clients: list[paramiko.SSHClient] = []
    sock: Any = None
    try:
        for i, hop in enumerate(hops):
            label = name if i == len(hops) - 1 else f"{name} (via jump host {hop.label})"
            client = _open(label, hop, settings, sock, known_file)
            clients.append(client)
            if i < len(hops) - 1:
                nxt = hops[i + 1]
                transport = client.get_transport()
                assert transport is not None
                try:
                    sock = transport.open_channel(
                        "direct-tcpip", (nxt.hostname, nxt.port), ("127.0.0.1", 0)
                    )
                except (paramiko.SSHException, OSError) as e:
                    raise ConnectError(
                        f"{name}: jump host {hop.label} cannot reach {nxt.hostname}:{nxt.port}: {e}"
                    ) from None
    except DisaggError:
        for c in clients:
            c.close()
        raise
    return Session(name, target, clients)


def connect_host(host: Host, settings: SshSettings) -> Session:
    return connect(host.name, target_for(host, settings), settings)


@dataclass
class HostResult(Generic[T]):
    host: str
    value: T | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def on_hosts(
    hosts: list[Host],
    settings: SshSettings,
    fn: Callable[[Host, Session], T],
) -> list[HostResult[T]]:
    """Connect to every host at once and run `fn(host, session)`; one result per host,
    in inventory order. Errors a user can act on become the host's `error`."""

    def one(host: Host) -> HostResult[T]:
        try:
            with connect_host(host, settings) as session:
                return HostResult(host.name, fn(host, session))
        except DisaggError as e:
            return HostResult(host.name, error=str(e))
        except Exception as e:  # a bug on one host must not hide the other hosts' results
            return HostResult(host.name, error=f"{host.name}: {type(e).__name__}: {e}")

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(one, hosts))


def q(s: str) -> str:
    """Quote for the remote POSIX shell."""
    return shlex.quote(s)

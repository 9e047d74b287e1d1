"""Fleet operations on deployed agents: start, stop, restart, status, logs.

Every function returns data (one result per host or agent); rendering is
render_fleet's job. An unreachable host is a result that says so.
"""

from __future__ import annotations

import heapq
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from disagg.errors import AgentError, DisaggError, ModelError
from disagg.fleet import service
from disagg.fleet.crashes import crash_tail_command, last_error_from_tails
from disagg.fleet.inventory import Agent, Host, Inventory
from disagg.fleet.service import AgentPaths, host_python, probe, remote_root, service_kind
from disagg.fleet.ssh import HostResult, Session, connect_host, on_hosts, q
from disagg.fleet.token import load_token
from disagg.safetext import strip_escapes
from disagg.serving.control import agent_status, parse_status
from disagg_agents.wire.frames import PeerAuthError
from disagg_agents.wire.status import AgentStatus
from disagg_agents.wire.text import printable

LOAD_TIMEOUT_S = 600.0  # a 120B model can take minutes to load
HTTP_TIMEOUT_S = 1.5

HostSay = Callable[[str, str], None]  # (host, message): progress, one host at a time


@dataclass
class AgentAction:
    host: str
    role: str
    action: str  # started | already running | stopped | not running | restarted
    detail: str = ""


def _tail_log(session: Session, paths: AgentPaths, n: int = 5, stderr: bool = True) -> str:
    """The end of the agent's log, then of its stderr (where a crash's traceback goes)."""
    cmd = f"tail -n {n} {q(paths.log)} 2>/dev/null"
    if stderr:
        cmd += f"; tail -n {n} {q(paths.stderr)} 2>/dev/null"
    return session.run(cmd).out.strip()


def start_agent(
    session: Session, paths: AgentPaths, kind: str, home: str, timeout_s: float = LOAD_TIMEOUT_S
) -> dict[str, Any]:
    """Start one agent and wait for its READY line; returns what READY said."""
    session.check(service.start(kind, paths, home))
    deadline = time.monotonic() + timeout_s
    poll = f"cat {q(paths.out)} 2>/dev/null; echo; {service.is_running(paths)} && echo @alive"
    seen_alive = False
    while time.monotonic() < deadline:
        out = session.run(poll).out
        for line in out.splitlines():
            if line.startswith("READY "):
                return dict(json.loads(line[len("READY ") :]))
            if line.startswith("FAILED "):
                raise ModelError(f"{session.name}: {paths.role} agent: {line[7:].strip()}")
        alive = "@alive" in out
        seen_alive |= alive
        # The pidfile appears a moment after start; only a vanished pid means it died.
        if seen_alive and not alive:
            raise AgentError(
                f"{session.name}: {paths.role} agent exited while starting; "
                f"{paths.log}, {paths.role}.stderr:\n{_tail_log(session, paths)}"
            )
        time.sleep(0.5)
    raise AgentError(
        f"{session.name}: {paths.role} agent not READY within {timeout_s:.0f}s; "
        f"{paths.log}, {paths.role}.stderr:\n{_tail_log(session, paths)}"
    )


def _lifecycle(
    inv: Inventory, hosts: list[str] | None, op: str, say: HostSay
) -> list[HostResult[list[AgentAction]]]:
    def run(host: Host, session: Session) -> list[AgentAction]:
        info = probe(session)
        kind, root = service_kind(host, info), remote_root(host, info)
        actions = []
        for a in inv.agents([host]):
            paths = AgentPaths(root, a.role)
            if session.run(f"test -f {q(paths.hash)}").rc != 0:
                raise AgentError(f"{host.name}: {a.role} agent is not deployed; run disagg deploy")
            running = session.run(service.is_running(paths)).rc == 0
            if op in ("stop", "restart"):
                if running:
                    session.check(service.stop(kind, paths))
                    say(host.name, f"{a.role} stopped")
                if op == "stop":
                    done = "stopped" if running else "not running"
                    actions.append(AgentAction(host.name, a.role, done))
                    continue
            elif running:
                actions.append(AgentAction(host.name, a.role, "already running"))
                continue
            say(host.name, f"starting {a.role} ({a.model})")
            t0 = time.monotonic()
            ready = start_agent(session, paths, kind, info.home)
            verb = "restarted" if op == "restart" and running else "started"
            detail = (
                f"ports {ready['port']}/{ready['control_port']} in {time.monotonic() - t0:.1f}s"
            )
            say(host.name, f"{a.role} {verb}: {detail}")
            actions.append(AgentAction(host.name, a.role, verb, detail))
        return actions

    return on_hosts(inv.select(hosts), inv.ssh, run)


def start(
    inv: Inventory, hosts: list[str] | None = None, say: HostSay = lambda _h, _m: None
) -> list[HostResult[list[AgentAction]]]:
    """Start the deployed agents that are not running; waits until each is READY."""
    return _lifecycle(inv, hosts, "start", say)


def stop(
    inv: Inventory, hosts: list[str] | None = None, say: HostSay = lambda _h, _m: None
) -> list[HostResult[list[AgentAction]]]:
    return _lifecycle(inv, hosts, "stop", say)


def restart(
    inv: Inventory, hosts: list[str] | None = None, say: HostSay = lambda _h, _m: None
) -> list[HostResult[list[AgentAction]]]:
    return _lifecycle(inv, hosts, "restart", say)


# ---- status ---------------------------------------------------------------------------


@dataclass
class HostProbe:
    """One agent of one host as `disagg status` found it: its state, where it
    answered, and its own /status, typed (its `doc` is what --json prints whole)."""

    host: str
    role: str
    state: str  # healthy | stopped | not responding | unreachable | not deployed
    address: str = ""  # where /status answered: ADDR:PORT, or "ssh"
    status: AgentStatus = field(default_factory=AgentStatus)  # the agent's own /status
    pid: int | None = None
    rss_bytes: int | None = None
    detail: str = ""
    ssh_error: str = ""  # set when the agent answers but its host cannot be managed

    @property
    def ok(self) -> bool:
        """Healthy, manageable, and its /status read whole (no field of another type)."""
        return self.state == "healthy" and not self.ssh_error and not self.status.mistyped


def _http_status(
    addresses: list[str], port: int, token: bytes | None
) -> tuple[str, AgentStatus] | str | None:
    """(ADDR:PORT, status) from the first address that answers, proving the token by
    challenge-response (it never crosses the wire); a string says what was wrong
    with an answer; None: nobody answered."""
    wrong: str | None = None
    for addr in addresses:
        try:
            return f"{addr}:{port}", agent_status(addr, port, token, HTTP_TIMEOUT_S)
        except (PeerAuthError, ValueError) as e:
            wrong = wrong or f"{addr}:{port}: {printable(e)}"
        except OSError:
            continue
    return wrong


# Run on the host itself with the agents' code there: it proves the token it reads
# there by challenge-response, so the token never travels, not even over loopback.
FETCH_SCRIPT = (
    "import sys; sys.path.insert(0, sys.argv[3]); "
    "from disagg_agents.wire.httpauth import control_get; "
    "t = open(sys.argv[2], 'rb').read().strip(); "
    "sys.stdout.write(control_get('127.0.0.1', int(sys.argv[1]), '/status', t, 3).decode())"
)


def _host_status(inv: Inventory, host: Host) -> list[HostProbe]:
    mine = inv.agents([host])
    token = load_token(inv.path)
    direct = {a.role: _http_status(host.addresses(), a.ports.control_port, token) for a in mine}
    rows: list[HostProbe] = []
    try:
        with connect_host(host, inv.ssh) as session:
            info = probe(session)
            root, py = remote_root(host, info), host_python(host, info)
            for a in mine:
                rows.append(_agent_status(session, a, AgentPaths(root, a.role), py, direct[a.role]))
    except DisaggError as e:
        # No ssh: whatever answered directly still counts; the rest is unreachable.
        for a in mine:
            if a.role in {r.role for r in rows}:
                continue
            found = direct[a.role]
            if isinstance(found, str):
                rows.append(HostProbe(host.name, a.role, "bad answer", detail=found))
            elif found:
                rows.append(HostProbe(host.name, a.role, "healthy", *found, ssh_error=str(e)))
            else:
                rows.append(HostProbe(host.name, a.role, "unreachable", detail=str(e)))
    return rows


def _agent_status(
    session: Session,
    a: Agent,
    paths: AgentPaths,
    py: str,
    direct: tuple[str, AgentStatus] | str | None,
) -> HostProbe:
    host = a.host.name
    if session.run(f"test -f {q(paths.hash)}").rc != 0:
        return HostProbe(host, a.role, "not deployed", detail="run disagg deploy")
    res = session.run(
        f"{service.is_running(paths)} && echo $pid && ps -o rss= -p $pid 2>/dev/null || true"
    )
    nums = [int(x) for x in res.out.split() if x.isdigit()]
    pid = nums[0] if nums else None
    rss = nums[1] * 1024 if len(nums) > 1 else None
    if pid is None:
        return HostProbe(host, a.role, "stopped")
    if isinstance(direct, str):
        return HostProbe(host, a.role, "bad answer", pid=pid, rss_bytes=rss, detail=direct)
    if direct:
        return HostProbe(host, a.role, "healthy", direct[0], direct[1], pid, rss)
    port, token_file = str(a.ports.control_port), f"{paths.root}/token"
    fetched = session.run(
        f"{q(py)} -c {q(FETCH_SCRIPT)} {port} {q(token_file)} {q(paths.root)}", timeout_s=10
    )
    if fetched.rc == 0:
        try:
            st = AgentStatus.from_json(parse_status(fetched.out))
        except ValueError as e:
            detail = f"via ssh: {printable(e)}"
            return HostProbe(host, a.role, "bad answer", pid=pid, rss_bytes=rss, detail=detail)
        note = "control port not reachable from here"
        return HostProbe(host, a.role, "healthy", "ssh", st, pid, rss, note)
    starting = session.run(f"grep -c '^READY ' {q(paths.out)}").out.strip() in ("", "0")
    state = "starting" if starting else "not responding"
    last = _tail_log(session, paths, 1, stderr=False)
    return HostProbe(host, a.role, state, pid=pid, rss_bytes=rss, detail=last)


def status(inv: Inventory, hosts: list[str] | None = None) -> list[HostProbe]:
    """One row per agent the pipelines place on the hosts, all hosts polled at once."""
    chosen = inv.select(hosts)
    rows: dict[str, list[HostProbe]] = {}
    threads = [
        threading.Thread(target=lambda h=h: rows.__setitem__(h.name, _host_status(inv, h)))
        for h in chosen
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for h in chosen for r in rows.get(h.name, [])]


# ---- crash lines ----------------------------------------------------------------------


def crash_line(inv: Inventory, agent_name: str) -> str | None:
    """Over SSH, the last error of a deployed agent named ROLE@HOST (as the
    inventory names it); None when it has none or its host cannot be reached."""
    role, _, host_name = agent_name.partition("@")
    host = inv.hosts.get(host_name)
    if host is None or role not in ("prefill", "decode"):
        return None
    try:
        with connect_host(host, inv.ssh) as session:
            root = remote_root(host, probe(session))
            paths = AgentPaths(root, role)
            out = session.run(crash_tail_command(paths.stderr, paths.log), timeout_s=10).out
    except DisaggError:
        return None
    return last_error_from_tails(out)


# ---- logs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LogLine:
    host: str
    role: str
    text: str
    error: bool = False
    stream: str = "log"  # "log": ROLE.log; "stderr": ROLE.stderr (a crash's traceback)
    stamp: str = ""  # stderr lines: the file's last change, to sort them among the log's


_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+")
STDERR_STAMP = "@stamp "  # the first line of a stderr tail: when the file last changed


def log_commands(paths: AgentPaths, n: int, follow: bool) -> list[tuple[str, str]]:
    """(stream, shell command) per file of one agent: its log, and its stderr, where
    what the agent could not log lands (a crash's traceback, a failed import). The
    stderr tail opens with the file's change time in the log's own format."""
    flag = "-F" if follow else ""
    err = q(paths.stderr)
    stamp = f"date -r {err} '+{STDERR_STAMP}%Y-%m-%d %H:%M:%S,999'"
    return [
        ("log", f"tail -n {int(n)} {flag} {q(paths.log)} 2>&1"),
        ("stderr", f"{{ test -s {err} && {stamp}; }}; tail -n {int(n)} {flag} {err} 2>/dev/null"),
    ]


def _read_log(inv: Inventory, host: Host, n: int, follow: bool, out: queue.Queue[Any]) -> None:
    try:
        with connect_host(host, inv.ssh) as session:
            info = probe(session)
            root = remote_root(host, info)
            chans = []
            for a in inv.agents([host]):
                for stream, cmd in log_commands(AgentPaths(root, a.role), n, follow):
                    chan = session.client.get_transport().open_session()
                    chan.exec_command(cmd)
                    chans.append((a.role, stream, chan))
            readers = [
                threading.Thread(target=_pump, args=(host.name, role, chan, out, s), daemon=True)
                for role, s, chan in chans
            ]
            for t in readers:
                t.start()
            for t in readers:
                t.join()
    except DisaggError as e:
        out.put(LogLine(host.name, "", f"error: {e}", error=True))
    finally:
        out.put(None)


def pump_lines(
    host: str, role: str, lines: Iterator[bytes], out: queue.Queue[Any], stream: str = "log"
) -> None:
    """Each line as a LogLine on `out`; a stderr tail's stamp line tags the lines after it."""
    stamp = ""
    for raw in lines:
        text = strip_escapes(raw.decode(errors="replace").rstrip("\n"))
        if stream == "stderr" and not stamp and text.startswith(STDERR_STAMP):
            stamp = text[len(STDERR_STAMP) :]
            continue
        out.put(LogLine(host, role, text, stream=stream, stamp=stamp))


def _pump(host: str, role: str, chan: Any, out: queue.Queue[Any], stream: str = "log") -> None:
    pump_lines(host, role, iter(chan.makefile("rb")), out, stream)


def merge_by_time(lines: list[LogLine]) -> list[LogLine]:
    """Each file's lines kept in order, files merged by timestamp. A line without
    one (a traceback's) sorts with the line before it; stderr lines with their
    file's change time, so a crash lands where it happened."""
    streams: dict[tuple[str, str, str], list[tuple[str, LogLine]]] = {}
    for item in lines:
        stream = streams.setdefault((item.host, item.role, item.stream), [])
        m = _STAMP.match(item.text)
        key = m.group(0) if m else (stream[-1][0] if stream else item.stamp)
        stream.append((key, item))
    return [line for _key, line in heapq.merge(*streams.values(), key=lambda kv: kv[0])]


def logs(
    inv: Inventory, hosts: list[str] | None = None, n: int = 50, follow: bool = False
) -> Iterator[LogLine]:
    """The last `n` lines of each agent's log, merged by time; with `follow`, new lines
    of all hosts as they come, until the caller stops iterating."""
    chosen = inv.select(hosts)
    out: queue.Queue[LogLine | None] = queue.Queue()
    for h in chosen:
        threading.Thread(target=_read_log, args=(inv, h, n, follow, out), daemon=True).start()
    if follow:
        open_hosts = len(chosen)
        while open_hosts:
            item = out.get()
            if item is None:
                open_hosts -= 1
            else:
                yield item
        return
    got: list[LogLine] = []
    done = 0
    while done < len(chosen):
        item = out.get()
        if item is None:
            done += 1
            continue
        got.append(item)
    yield from merge_by_time(got)

"""What a connection may cost the gateway before it is a request.

uvicorn alone takes any number of connections and waits forever for a request's
first byte: a few dozen silent sockets under a low open-files limit held the
gateway, and asyncio then logged every refused accept. Here, at the transport:
connections are capped per network (an IPv4 /24, an IPv6 /64) and in total, near
the open-files limit, which is raised to its hard limit at start; at a cap the
oldest connection that has not sent a request's headers is closed to make room
(1,024 silent sockets once locked keyed clients out); a connection must send its
first byte within a deadline and a request's headers within a longer one (the
guard bounds the body); and the OS refusing sockets is logged at most once per
LOG_EVERY_S.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from disagg.frontends.shutdown import Drain, DrainingServer
from disagg_agents.runtime.gate import peer_key

HEADER_TIMEOUT_S = 10.0  # from connect (or the last response) to a request's full headers
FIRST_BYTE_TIMEOUT_S = 5.0  # from connect to its first byte (shorter: a silent socket goes first)
MAX_CONNECTIONS: int | None = None  # None: the open-files limit less FD_HEADROOM
MAX_PER_NETWORK = 64  # from one IPv4 /24 or one IPv6 /64
FD_HEADROOM = 64  # files kept free beyond the connections: agents' sockets, logs, accept
NOFILE_WANTED = 65536
LOG_EVERY_S = 10.0

log = logging.getLogger("disagg.gateway")


@dataclass
class Limits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int | None = MAX_CONNECTIONS
    max_per_address: int = MAX_PER_NETWORK  # per IPv4 /24 or IPv6 /64 (network_key)
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S


def network_key(addr: str) -> str:
    """Whose connection it is, for the per-network cap: an IPv4 /24, an IPv6 /64
    (one host, or one client's NAT pool, can own either)."""
    key = peer_key(addr)
    try:
        ip = ipaddress.ip_address(key)
    except ValueError:
        return key  # already a /64, or not an address
    return str(ipaddress.ip_network(f"{ip}/24", strict=False))


def raise_nofile(wanted: int = NOFILE_WANTED) -> int:
    """Raise the soft open-files limit toward the hard one; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return NOFILE_WANTED if soft == resource.RLIM_INFINITY else int(soft)


def open_files() -> int:
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d))
        except OSError:
            continue
    return 0


def connection_cap(limits: Limits, nofile: int) -> int:
    """Connections at once: the open-files limit less what is open and a headroom,
    or the asked cap if lower."""
    room = nofile - open_files() - FD_HEADROOM
    asked = limits.max_connections
    return max(8, room if asked is None else min(asked, room))


class Conn(Protocol):
    def evict(self) -> None: ...


class Admission:
    """Open connections per network and in total, and which of them have not sent
    a request's headers yet, oldest first (event-loop thread only). At a cap the
    oldest such connection (in that network, or anywhere for the total) makes room:
    silent sockets cannot keep a client that talks out."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total, self.per_address = total, per_address
        self.open: dict[str, int] = {}
        self.count = 0
        self.refused = self.evicted = 0
        self.silent: OrderedDict[Conn, str] = OrderedDict()  # not yet sent headers
        self.silent_in: dict[str, OrderedDict[Conn, None]] = {}
        self._told_at = 0.0

    def admit(self, conn: Conn, addr: str) -> bool:
        key = network_key(addr)
        full_here = self.open.get(key, 0) >= self.per_address
        if full_here and not self._evict(key):
            return self._refuse(key)
        if self.count >= self.total and not self._evict(None):
            return self._refuse(key)
        self.open[key] = self.open.get(key, 0) + 1
        self.count += 1
        return True

    def _evict(self, key: str | None) -> bool:
        pool = self.silent if key is None else self.silent_in.get(key)
        if not pool:
            return False
        victim = next(iter(pool))
        self.evicted += 1
        victim.evict()  # releases it here, at once
        return True

    def _refuse(self, key: str) -> bool:
        self.refused += 1
        now = time.monotonic()
        if now - self._told_at >= LOG_EVERY_S:
            self._told_at = now
            log.warning(
                "refused connections (%d so far): %d open, %d from %s",
                self.refused,
                self.count,
                self.open.get(key, 0),
                key,
            )
        return False

    def waiting(self, conn: Conn, addr: str) -> None:
        """`conn` waits for a request's headers (new, or kept alive after a response)."""
        key = network_key(addr)
        self.silent[conn] = key
        self.silent_in.setdefault(key, OrderedDict())[conn] = None

    def heard(self, conn: Conn) -> None:
        """`conn` sent a request's headers (or is gone)."""
        key = self.silent.pop(conn, None)
        if key is None:
            return
        mine = self.silent_in.get(key)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.silent_in[key]

    def release(self, conn: Conn, addr: str) -> None:
        self.heard(conn)
        key = network_key(addr)
        self.count -= 1
        left = self.open.get(key, 0) - 1
        if left > 0:
            self.open[key] = left
        else:
            self.open.pop(key, None)


class LimitedProtocol(H11Protocol):
    """uvicorn's h11 protocol with admission (evicting the oldest silent connection
    at a cap), a first-byte deadline and a headers deadline; `limited_protocol`
    gives it its limits and admission."""

    conn_limits: Limits
    admission: Admission
    _addr: str | None = None
    _timer: Any = None
    _first: Any = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        addr = (self.client or ("?", 0))[0]
        if not self.admission.admit(self, addr):
            transport.abort()  # no answer: an answer would cost what we refuse to spend
            return
        self._addr = addr
        self._first = self.loop.call_later(self.conn_limits.first_byte_timeout_s, self._late)
        self._arm()

    def _idle(self) -> bool:
        """No request under way: waiting for the next one's headers."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        # Fires unless a request is under way by then.
        assert self._addr is not None
        self.admission.waiting(self, self._addr)
        self._timer = self.loop.call_later(self.conn_limits.header_timeout_s, self._late)

    def _late(self) -> None:
        if self._idle() and not self.transport.is_closing():
            self.evict()

    def evict(self) -> None:
        """Close now and give its place back at once (abort's connection_lost comes later)."""
        self._release()
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._first is not None:
            self._first.cancel()
            self._first = None
        super().data_received(data)
        if not self._idle():
            self.admission.heard(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._timer is not None and not self.transport.is_closing():
            self._timer.cancel()
            if self._idle():
                self._arm()  # a kept-alive connection's next headers, on the same terms

    def _release(self) -> None:
        for timer in (self._timer, self._first):
            if timer is not None:
                timer.cancel()
        if self._addr is not None:
            self.admission.release(self, self._addr)
            self._addr = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)


def limited_protocol(limits: Limits, admission: Admission) -> type[H11Protocol]:
    """LimitedProtocol bound to these limits and this admission."""
    attrs = {"conn_limits": limits, "admission": admission}
    return type("Limited", (LimitedProtocol,), attrs)


class OncePer(logging.Filter):
    """Lets one record about refused sockets through per `seconds`."""

    MARKS = ("Too many open files", "out of system resource", "EMFILE", "ENFILE")

    def __init__(self, seconds: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.seconds = seconds
        self._at = -seconds
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]}"
        if not any(m in text for m in self.MARKS):
            return True
        now = time.monotonic()
        if now - self._at < self.seconds:
            self.dropped += 1
            return False
        self._at = now
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} more like it not logged)"
            self.dropped = 0
        return True


def serve(
    app: Any, host: str, port: int, limits: Limits | None = None, drain: Drain | None = None
) -> None:
    """Run `app` with uvicorn under these limits until a signal stops it (`drain`:
    how, disagg.frontends.shutdown)."""
    limits = limits or Limits()
    nofile = raise_nofile()
    cap = connection_cap(limits, nofile)
    quiet = OncePer()
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(quiet)
    admission = Admission(cap, min(limits.max_per_address, cap))
    log.info("at most %d connections, %d per /24 or /64", cap, admission.per_address)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=limited_protocol(limits, admission),
        backlog=min(2048, cap),
    )
    if drain is None:
        uvicorn.Server(config).run()
        return
    server = DrainingServer(config, drain)
    server.run()
    server.exit_as_signalled()

"""What a connection may cost the gateway before it is a request.

uvicorn alone takes any number of connections and waits forever for a request's
first byte: a few dozen silent sockets under a low open-files limit held the
gateway, and asyncio then logged every refused accept. Here, at the transport:
connections are capped per address (an IPv6 /64 is one) and in total, below the
open-files limit, which is raised to its hard limit at start; a connection must
deliver a request's headers within a deadline (the guard bounds the body); and
the OS refusing sockets is logged at most once per LOG_EVERY_S.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agents.runtime.server import peer_key
from disagg.frontends.shutdown import Drain, DrainingServer

HEADER_TIMEOUT_S = 10.0  # from connect (or the last response) to a request's full headers
MAX_CONNECTIONS = 1024
MAX_PER_ADDRESS = 64
FD_HEADROOM = 64  # files kept free beyond the connections: agents' sockets, logs, accept
NOFILE_WANTED = 65536
LOG_EVERY_S = 10.0

log = logging.getLogger("disagg.gateway")


@dataclass
class Limits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_per_address: int = MAX_PER_ADDRESS


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
    """Connections at once: the asked cap, but always leaving files free."""
    return max(8, min(limits.max_connections, nofile - open_files() - FD_HEADROOM))


class Admission:
    """Open connections per address and in total (event-loop thread only)."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total, self.per_address = total, per_address
        self.open: dict[str, int] = {}
        self.count = 0
        self.refused = 0
        self._told_at = 0.0

    def admit(self, addr: str) -> bool:
        key = peer_key(addr)
        if self.count >= self.total or self.open.get(key, 0) >= self.per_address:
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
        self.open[key] = self.open.get(key, 0) + 1
        self.count += 1
        return True

    def release(self, addr: str) -> None:
        key = peer_key(addr)
        self.count -= 1
        left = self.open.get(key, 0) - 1
        if left > 0:
            self.open[key] = left
        else:
            self.open.pop(key, None)


def limited_protocol(limits: Limits, admission: Admission) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the admission check and the headers deadline."""

    class Limited(H11Protocol):
        _addr: str | None = None
        _timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            addr = (self.client or ("?", 0))[0]
            if not admission.admit(addr):
                transport.abort()  # no answer: an answer would cost what we refuse to spend
                return
            self._addr = addr
            self._arm()

        def _arm(self) -> None:
            # Fires unless a new request's headers arrived (uvicorn starts a new cycle).
            waiting_on = self.cycle
            self._timer = self.loop.call_later(limits.header_timeout_s, self._late, waiting_on)

        def _late(self, waiting_on: Any) -> None:
            if self.cycle is waiting_on and not self.transport.is_closing():
                self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._timer is not None and not self.transport.is_closing():
                self._timer.cancel()
                self._arm()  # a kept-alive connection's next headers, on the same terms

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            if self._addr is not None:
                admission.release(self._addr)
                self._addr = None
            super().connection_lost(exc)

    return Limited


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
    log.info("at most %d connections, %d per address", cap, admission.per_address)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=limited_protocol(limits, admission),
        backlog=min(2048, cap),
    )
    (DrainingServer(config, drain) if drain is not None else uvicorn.Server(config)).run()

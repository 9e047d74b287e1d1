"""Who gets a connection slot: caps on connections at once, per agent and per peer,
with a reserve for the cluster's own addresses that strangers cannot fill."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

log = logging.getLogger("disagg.agent")

# A peer must finish the handshake within this, however it trickles: two tiny
# frames, milliseconds on a LAN; short, so a flood must renew its sockets often.
HANDSHAKE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 512  # per agent, authenticated or not; half at most unauthenticated
MAX_PREAUTH_PER_PEER = 64  # unauthenticated connections from one address at once

LOOPBACK = frozenset({"127.0.0.1", "::1"})  # the local pair and its client


def peer_key(addr: str) -> str:
    """What one peer is, for the per-peer cap: an IPv4 address, an IPv6 /64
    (one host may own a whole /64, so its addresses count as one)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def trusted_set(peers: str | list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """`--trusted-peers` (comma-separated addresses) plus loopback, as peer keys."""
    items = peers.split(",") if isinstance(peers, str) else list(peers)
    return frozenset(peer_key(p.strip()) for p in [*items, *LOOPBACK] if p.strip())


class Gate:
    """Caps connections: `total` at once, of which at most half unauthenticated,
    and at most `preauth_per_peer` unauthenticated ones from one peer (an IPv6
    /64 is one). `trusted` peers (the inventory's addresses, loopback) have
    their own unauthenticated slots, so strangers filling theirs cannot lock
    the cluster out. A refused connection is closed before it costs a thread.

    Connections admitted with their socket (`conn`) can be evicted: when a pool
    of unauthenticated slots is full, its oldest connection is shut down to make
    room (a stranger over its own per-peer cap is still refused). Any local user
    reaches loopback's reserve: 300 silent sockets there once turned every gateway
    request into a 503; now they only push each other out, and a peer that
    authenticates at once gets in."""

    def __init__(
        self,
        total: int,
        preauth_per_peer: int,
        preauth_total: int | None = None,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.total = total
        self.preauth_total = max(1, total // 2) if preauth_total is None else preauth_total
        self.preauth_per_peer = preauth_per_peer
        self.trusted = trusted or trusted_set()
        self.open = 0
        self.preauth: dict[str, int] = {}
        self.trusted_preauth = 0
        self.lock = threading.Lock()
        self.refused = self.evicted = 0
        self._told_at = 0.0
        # Tracked connections: unauthenticated ones oldest first (peer key, trusted), and
        # the authenticated; one evicted is in neither, so its own release does nothing.
        self.pending: OrderedDict[Any, tuple[str, bool]] = OrderedDict()
        self.authed: set[Any] = set()

    def admit(self, peer: str, conn: Any = None) -> str | None:
        """Take a slot for a new, unauthenticated connection; else why not. With
        `conn` (its socket) it may take the slot of the oldest one in a full pool."""
        key = peer_key(peer)
        victim = None
        with self.lock:
            full = self._full(key)
            if full is not None and conn is not None and full[1] != "peer":
                victim = self._oldest(key in self.trusted)
                if victim is not None:
                    self._drop(victim)
                    full = self._full(key)
            if full is None:
                self.open += 1
                if key in self.trusted:
                    self.trusted_preauth += 1
                else:
                    self.preauth[key] = self.preauth.get(key, 0) + 1
                if conn is not None:
                    self.pending[conn] = (key, key in self.trusted)
        if victim is not None:
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)  # wakes its handler's read: it ends
        return None if full is None else self._refuse(full[0])

    def _full(self, key: str) -> tuple[str, str] | None:
        """Why a new unauthenticated connection from `key` has no slot, and which cap
        ("pool": a shared one; "peer": its own); None: it has one."""
        if key in self.trusted:  # the reserve: never counted with strangers
            if self.trusted_preauth >= self.preauth_total:
                return f"{self.preauth_total} unauthenticated connections from the cluster", "pool"
            if self.open >= self.total + self.preauth_total:
                return f"{self.open} connections open", "pool"
            return None
        # Its own cap first: a peer at it is refused, never let evict the oldest (its own).
        if self.preauth.get(key, 0) >= self.preauth_per_peer:
            why = f"{self.preauth_per_peer} unauthenticated connections from {key} open"
            return why, "peer"  # a peer over its own cap only costs itself: refused
        if self.open >= self.total:
            return f"{self.open} connections open", "pool"
        if sum(self.preauth.values()) >= self.preauth_total:
            return f"{self.preauth_total} unauthenticated connections open", "pool"
        return None

    def _oldest(self, trusted: bool) -> Any:
        """The oldest unauthenticated connection of a pool (the reserve's, or strangers')."""
        return next((c for c, (_, t) in self.pending.items() if t == trusted), None)

    def _drop(self, conn: Any) -> None:
        key, _ = self.pending.pop(conn)
        self.evicted += 1
        self.open -= 1
        self._leave_preauth_key(key)

    def _refuse(self, why: str) -> str:
        with self.lock:
            self.refused += 1
            # One line per 10 s at most: a flood must not flood the log too.
            now = time.monotonic()
            if now - self._told_at < 10:
                return why
            self._told_at, count = now, self.refused
        log.warning("refused connections (%d so far): %s", count, why)
        return why

    def authenticated(self, peer: str, conn: Any = None) -> bool:
        """The connection proved the token; False: it was evicted meanwhile."""
        with self.lock:
            if conn is not None:
                if self.pending.pop(conn, None) is None:
                    return False
                self.authed.add(conn)
            self._leave_preauth(peer)
            return True

    def _leave_preauth(self, peer: str) -> None:
        self._leave_preauth_key(peer_key(peer))

    def _leave_preauth_key(self, key: str) -> None:
        if key in self.trusted:
            self.trusted_preauth -= 1
            return
        left = self.preauth.get(key, 0) - 1
        if left > 0:
            self.preauth[key] = left
        else:
            self.preauth.pop(key, None)

    def release(self, peer: str, authenticated: bool, conn: Any = None) -> None:
        with self.lock:
            if conn is not None:
                if authenticated:
                    if conn not in self.authed:
                        return
                    self.authed.discard(conn)
                elif self.pending.pop(conn, None) is None:
                    return  # evicted: its slot was given back then
            self.open -= 1
            if not authenticated:
                self._leave_preauth(peer)

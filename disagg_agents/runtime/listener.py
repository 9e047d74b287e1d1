"""The data port: a threaded TCP listener that admits a connection through the gate,
has it prove the cluster token within the handshake deadline, then hands the socket
to the agent. And the Reaper, which cuts off sockets that outlive their deadline."""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from disagg_agents.runtime.gate import (
    HANDSHAKE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_PREAUTH_PER_PEER,
    Gate,
)
from disagg_agents.wire.auth import server_auth
from disagg_agents.wire.frames import Deadline, PeerAuthError, ProtocolError
from disagg_agents.wire.text import printable

log = logging.getLogger("disagg.agent")

IDLE_TIMEOUT_S = 600.0  # an open connection with no request for this long is closed


class FrameServer(socketserver.ThreadingTCPServer):
    """The data port: a connection the gate admits has the handshake deadline to prove
    the token, then `handle` (the agent's) has its socket and the peer's name."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 overflows when dozens of clients connect at once

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket, str], None],
        token: bytes | None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_preauth_per_peer: int = MAX_PREAUTH_PER_PEER,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.gate = Gate(max_connections, max_preauth_per_peer, trusted=trusted)
        self.handshake_timeout_s = handshake_timeout_s  # a live setting: read per connection
        self.token = token
        self.agent_handle = handle
        super().__init__((host, port), FrameHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.gate.admit(client_address[0], request) is not None:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)


class FrameHandler(socketserver.BaseRequestHandler):
    """One data connection: the handshake, then the agent's own handling."""

    server: FrameServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        addr = self.client_address[0]
        peer = f"{addr}:{self.client_address[1]}"
        if not self.authenticate(sock, addr, peer):
            return
        try:
            self.server.agent_handle(sock, peer)
        except Exception:  # a bad connection must never take the agent down
            log.exception("connection from %s failed", peer)
        finally:
            self.server.gate.release(addr, authenticated=True, conn=sock)

    def authenticate(self, sock: socket.socket, addr: str, peer: str) -> bool:
        """The token proven within the handshake deadline; False: the connection is
        done, its slot given back."""
        server, authed = self.server, False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = Deadline(server.handshake_timeout_s)
            sock.settimeout(server.handshake_timeout_s)
            server_auth(sock, server.token, deadline)
            sock.settimeout(IDLE_TIMEOUT_S)
            if not server.gate.authenticated(addr, sock):
                return False  # evicted as it authenticated: its slot is gone
            authed = True
        except PeerAuthError as e:
            log.warning("refused %s: %s", peer, printable(e))
        except (OSError, ProtocolError) as e:
            log.info("dropped %s before it authenticated: %s", peer, printable(e))
        finally:
            if not authed:
                server.gate.release(addr, authenticated=False, conn=sock)
        return authed


class Reaper:
    """Closes sockets that outlive their deadline, from one thread for all: an
    HTTP client trickling its request a byte at a time is cut off at the end."""

    def __init__(self) -> None:
        self.due: dict[socket.socket, float] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="reaper").start()

    def watch(self, sock: socket.socket, seconds: float) -> None:
        with self.lock:
            self.due[sock] = time.monotonic() + seconds

    def forget(self, sock: socket.socket) -> None:
        with self.lock:
            self.due.pop(sock, None)

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self.lock:
                late = [s for s, at in self.due.items() if at <= now]
                for s in late:
                    del self.due[s]
            for s in late:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read

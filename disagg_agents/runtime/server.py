"""What both agents share: a threaded TCP listener for frames, a small HTTP
control endpoint (GET /health, GET /status), and the READY line that tells
whoever started the agent which ports it got.

Nobody without the token costs an agent much: a connection must finish the
handshake within one deadline, in frames of a few kB; unauthenticated
connections are capped per peer address and all connections per agent; the
control port caps its connections and bounds each request's whole life."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import logging.handlers
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

from disagg_agents.prefix.store import default_max_mb
from disagg_agents.runtime.metrics import LAST_ERROR, Stats
from disagg_agents.runtime.settings import MAX_BODY_BYTES as MAX_SETTINGS_BODY
from disagg_agents.runtime.settings import Setting, Settings, SettingsError
from disagg_agents.wire.auth import TOKEN_MIN_CHARS, server_auth
from disagg_agents.wire.frames import CONTROL_MAX_FRAME, AuthError, Deadline, ProtocolError
from disagg_agents.wire.httpauth import PROOF_HEADER, ServerAuth
from disagg_agents.wire.text import printable

log = logging.getLogger("disagg.agent")

LOG_LINE_MAX = 4000  # characters of one log message; peer text is cut far shorter
LOG_MAX_BYTES = 16 << 20  # --log-file rotates at this size, keeping LOG_BACKUPS old files
LOG_BACKUPS = 3


class OneLineFormatter(logging.Formatter):
    """Every record's message on one line, control characters shown escaped
    (`\\x1b`, `\\n`): nothing a peer says can forge a line or drive a terminal.
    Tracebacks keep their own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message, LOG_LINE_MAX)
        return super().formatMessage(record)


def setup_logging(role: str, log_file: str | None = None, max_bytes: int = LOG_MAX_BYTES) -> None:
    """Log to stderr, or to `log_file` rotated at `max_bytes` (LOG_BACKUPS kept)."""
    handler: logging.Handler
    if log_file:
        handler = logging.handlers.RotatingFileHandler(
            log_file, maxBytes=max_bytes, backupCount=LOG_BACKUPS
        )
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in root.handlers:
        if old is not LAST_ERROR:
            old.close()  # a second call (preflight, then start_agent) replaces the first
    root.handlers[:] = [handler, LAST_ERROR]
    root.setLevel(logging.INFO)


# A peer must finish the handshake within this, however it trickles: two tiny
# frames, milliseconds on a LAN; short, so a flood must renew its sockets often.
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 600.0  # an open connection with no request for this long is closed
MAX_CONNECTIONS = 512  # per agent, authenticated or not; half at most unauthenticated
MAX_PREAUTH_PER_PEER = 64  # unauthenticated connections from one address at once
CONTROL_MAX_CONNECTIONS = 64  # HTTP control port, at once
CONTROL_MAX_PER_PEER = 16


def fail(message: str) -> NoReturn:
    """Exit with one line the launcher can show to the user as is."""
    print(f"FAILED {message}", flush=True)
    log.error("%s", message)
    raise SystemExit(1)


def common_args(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m agents.{role}")
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address(es) to bind, comma-separated (both ports); 0.0.0.0 only if told",
    )
    p.add_argument("--port", type=int, default=0, help="KV/data TCP port (0: any free)")
    p.add_argument("--control-port", type=int, default=0, help="HTTP control port (0: any free)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, or a framework device name")
    p.add_argument("--name", default=None, help="how this agent names itself in metrics")
    p.add_argument(
        "--token-file",
        default=None,
        help="cluster token (0600); without it the agent accepts anyone",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=CONTROL_MAX_FRAME,
        help="largest control frame (request, hello) accepted from a peer",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=HANDSHAKE_TIMEOUT_S,
        help="seconds a new connection has to authenticate (an HTTP call: to be answered)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="connections at once on the data port (half at most unauthenticated)",
    )
    p.add_argument(
        "--max-preauth-per-peer",
        type=int,
        default=MAX_PREAUTH_PER_PEER,
        help="unauthenticated connections at once from one address",
    )
    p.add_argument(
        "--trusted-peers",
        default="",
        help="the cluster's own addresses, comma-separated (disagg deploy passes the "
        "inventory's): their connections have slots strangers cannot fill (loopback always)",
    )
    p.add_argument("--log-file", default=None, help="log here, rotated by size (else stderr)")
    p.add_argument(
        "--log-max-bytes", type=int, default=LOG_MAX_BYTES, help="rotate --log-file at this size"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        help="memory for prompt K/V reused across requests sharing a prefix "
        f"(default min(2 GiB, 10%% of RAM): {default_max_mb()} MB here; 0: off)",
    )
    return p


E = TypeVar("E")


def preflight(role: str, check_model: Callable[[str], None]) -> None:
    """What an agent can refuse before torch or mlx loads (seconds of a start): a
    token file it must not use, a checkpoint `check_model` refuses (one neither agent
    can run, or whose headers lie). One FAILED line in a fraction of a second;
    start_agent checks again."""
    from disagg_agents.models import UnsupportedModel

    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        return  # the whole parser, with the role's own flags, answers that
    args, _ = common_args(role).parse_known_args(argv)
    setup_logging(role, args.log_file, args.log_max_bytes)
    load_token(args.token_file)
    try:
        check_model(args.model)
    except UnsupportedModel as e:
        fail(str(e))


def start_agent(
    role: str, parser: argparse.ArgumentParser, load: Callable[[argparse.Namespace], E]
) -> tuple[argparse.Namespace, bytes | None, E]:
    """An agent's start, whatever its role: options, logging, the cluster token, and
    the engine `load` builds (an unsupported model ends here with one FAILED line)."""
    from disagg_agents.models import UnsupportedModel

    args = parser.parse_args()
    setup_logging(role, args.log_file, args.log_max_bytes)
    token = load_token(args.token_file)
    try:
        engine = load(args)
    except UnsupportedModel as e:
        fail(str(e))
    log.info("loaded %s on %s as %s", args.model, engine.device, engine.dtype)  # type: ignore[attr-defined]
    return args, token, engine


def load_token(path: str | None) -> bytes | None:
    """The cluster token, refusing a file that others may read."""
    if path is None:
        return None
    try:
        st = os.stat(path)
        token = Path(path).read_bytes().strip()
    except OSError as e:
        fail(f"cannot read token file {path}: {e.strerror}")
    if st.st_mode & 0o077:
        fail(f"token file {path} is readable by others; fix: chmod 600 {path}")
    if len(token) < TOKEN_MIN_CHARS:
        what = "is empty" if not token else f"holds only {len(token)} characters"
        fail(
            f"token file {path} {what}, a cluster token has at least {TOKEN_MIN_CHARS}; "
            "fix: copy the operator's token there again (disagg deploy does), chmod 600"
        )
    return token


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


class FrameServer(socketserver.ThreadingTCPServer):
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
        self.gate = gate = Gate(max_connections, max_preauth_per_peer, trusted=trusted)
        self.handshake_timeout_s = handshake_timeout_s  # a live setting: read per connection
        server = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(inner) -> None:
                sock: socket.socket = inner.request
                addr = inner.client_address[0]
                peer = f"{addr}:{inner.client_address[1]}"
                authed = False
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    deadline = Deadline(server.handshake_timeout_s)
                    sock.settimeout(server.handshake_timeout_s)
                    server_auth(sock, token, deadline)
                    sock.settimeout(IDLE_TIMEOUT_S)
                    if not gate.authenticated(addr, sock):
                        return  # evicted as it authenticated: its slot is gone
                    authed = True
                except AuthError as e:
                    log.warning("refused %s: %s", peer, printable(e))
                    return
                except (OSError, ProtocolError) as e:
                    log.info("dropped %s before it authenticated: %s", peer, printable(e))
                    return
                finally:
                    if not authed:
                        gate.release(addr, authenticated=False, conn=sock)
                try:
                    handle(sock, peer)
                except Exception:  # a bad connection must never take the agent down
                    log.exception("connection from %s failed", peer)
                finally:
                    gate.release(addr, authenticated=True, conn=sock)

        super().__init__((host, port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.gate.admit(client_address[0], request) is not None:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)


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


class ControlServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # as FrameServer: a burst must not wait on SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        handler: Any,
        deadline_s: float,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(address, handler)
        # Every HTTP connection stays "unauthenticated" in the gate's terms.
        self.gate = Gate(
            CONTROL_MAX_CONNECTIONS, CONTROL_MAX_PER_PEER, CONTROL_MAX_CONNECTIONS, trusted
        )
        self.reaper = Reaper()
        self.deadline_s = deadline_s

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.gate.admit(client_address[0], request) is not None:
            self.shutdown_request(request)
            return
        self.reaper.watch(request, self.deadline_s)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.reaper.forget(request)
        super().shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gate.release(client_address[0], authenticated=False, conn=request)


UNAUTHORIZED = (
    b'{"error": "unauthorized: answer the Disagg-HMAC challenge (disagg_agents.wire.httpauth)"}'
)


def put_settings(handler: Any, auth: ServerAuth | None, settings: Settings | None) -> None:
    """PUT /settings on the control port: the body is read (bounded) first, since the
    client's MAC covers it; only an agent with a token takes changes."""

    def error(code: int, why: str) -> None:
        handler._answer(code, "application/json", json.dumps({"error": why}).encode(), {})

    length = handler.headers.get("Content-Length", "")
    if not length.isdigit() or int(length) > MAX_SETTINGS_BODY:
        error(413, f"a PUT needs a Content-Length of at most {MAX_SETTINGS_BODY} bytes")
        return
    body = handler.rfile.read(int(length))
    if handler.path != "/settings" or settings is None:
        error(404, "no such endpoint")
        return
    if auth is None:
        error(403, "this agent runs without a cluster token: it takes no changes")
        return
    checked = auth.check("PUT", handler.path, handler.headers.get("Authorization"), body)
    if isinstance(checked, str):
        handler._refuse(auth, checked)
        return
    code, raw = change_settings(settings, body, handler.client_address[0])
    proof = auth.proof("PUT", handler.path, *checked, code, raw)
    handler._answer(code, "application/json", raw, {PROOF_HEADER: proof})


def change_settings(settings: Settings, body: bytes, peer: str) -> tuple[int, bytes]:
    """A token holder's PUT /settings: (HTTP status, answer); the change is logged."""
    try:
        changed = settings.change(json.loads(body))
    except (ValueError, SettingsError) as e:  # JSON's errors are ValueErrors
        return 400, json.dumps({"error": printable(e, 300)}).encode()
    if changed:
        told = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        log.info("settings changed by %s: %s", peer, told)
    return 200, json.dumps({"settings": settings.values(), "changed": changed}).encode()


def start_control(
    host: str,
    port: int,
    status: Callable[[], dict[str, Any]],
    metrics: Callable[[], str],
    token: bytes | None,
    draining: threading.Event,
    deadline_s: float = HANDSHAKE_TIMEOUT_S,
    trusted: frozenset[str] = frozenset(),
    settings: Settings | None = None,
) -> ThreadingHTTPServer:
    """GET /health for anyone; /status, /metrics and /settings for token holders,
    proven by challenge-response (disagg_agents.wire.httpauth) so the token never crosses
    the wire; PUT /settings (a signed body) changes live settings."""
    auth = ServerAuth(token) if token is not None else None

    class _Handler(BaseHTTPRequestHandler):
        timeout = deadline_s  # per read; the server's Reaper bounds the whole request

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            kind = "application/json"
            extra: dict[str, str] = {}
            proven: tuple[str, str] | None = None
            if self.path == "/health":
                # A draining agent says so, so routers send new work elsewhere.
                ok = not draining.is_set()
                raw, code = json.dumps({"ok": ok, "draining": not ok}).encode(), 200 if ok else 503
                self._answer(code, kind, raw, extra)
                return
            if auth is not None:
                checked = auth.check("GET", self.path, self.headers.get("Authorization"))
                if isinstance(checked, str):
                    self._refuse(auth, checked)
                    return
                proven = checked
            if self.path == "/status":
                raw, code = json.dumps(status()).encode(), 200
            elif self.path == "/metrics":
                raw, code = metrics().encode(), 200
                kind = "text/plain; version=0.0.4"
            elif self.path == "/settings" and settings is not None:
                raw, code = json.dumps({"settings": settings.values()}).encode(), 200
            else:
                raw, code = b'{"error": "no such endpoint"}', 404
            if auth is not None and proven is not None:
                extra[PROOF_HEADER] = auth.proof("GET", self.path, *proven, code, raw)
            self._answer(code, kind, raw, extra)

        def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
            put_settings(self, auth, settings)

        def _refuse(self, auth: ServerAuth, why: str) -> None:
            if why != "no credentials":  # a bare request is the protocol's first step
                log.warning(
                    "refused HTTP %s %s from %s: %s",
                    self.command,
                    printable(self.path, 100),
                    self.client_address[0],
                    why,
                )
            self._answer(
                401, "application/json", UNAUTHORIZED, {"WWW-Authenticate": auth.challenge()}
            )

        def _answer(self, code: int, kind: str, raw: bytes, extra: dict[str, str]) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(raw)))
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # health polls would drown the agent's log

    server = ControlServer((host, port), _Handler, deadline_s, trusted)
    threading.Thread(target=server.serve_forever, daemon=True, name="control").start()
    return server


class Agent(Protocol):
    """What serve() needs of a prefill or decode agent."""

    stats: Stats

    def handle(self, sock: socket.socket, peer: str) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def live_settings(self) -> list[Setting]: ...


def listener_settings(
    frames: list[FrameServer], controls: list[ThreadingHTTPServer]
) -> list[Setting]:
    """What both roles let an operator change live: the data port's caps and
    handshake deadline (new connections), the log's rotation size."""

    def deadline(v: float) -> None:
        for f in frames:
            f.handshake_timeout_s = v
        for c in controls:
            c.deadline_s = v  # type: ignore[attr-defined]
            c.RequestHandlerClass.timeout = v  # type: ignore[attr-defined]

    def gates(**fields: int) -> Callable[[int], None]:
        def apply(v: int) -> None:
            for f in frames:
                with f.gate.lock:
                    for name, share in fields.items():
                        setattr(f.gate, name, max(1, v // share))

        return apply

    # setup_logging's file handler (--log-file); an agent logging to stderr has none.
    rotating = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.handlers.RotatingFileHandler)
    ]

    def rotate_at(v: int) -> None:
        for h in rotating:
            h.maxBytes = v

    gate = frames[0].gate
    logs = [
        Setting(
            "log_max_bytes",
            int,
            lambda: rotating[0].maxBytes,
            rotate_at,
            1024,
            1 << 40,
            "rotate --log-file at this size",
        )
    ]
    return [
        Setting(
            "handshake_timeout_s",
            float,
            lambda: frames[0].handshake_timeout_s,
            deadline,
            0.1,
            600.0,
            "seconds a new connection has to authenticate",
        ),
        Setting(
            "max_connections",
            int,
            lambda: gate.total,
            gates(total=1, preauth_total=2),
            2,
            1 << 16,
            "connections at once on the data port (half at most unauthenticated)",
        ),
        Setting(
            "max_preauth_per_peer",
            int,
            lambda: gate.preauth_per_peer,
            gates(preauth_per_peer=1),
            1,
            1 << 16,
            "unauthenticated connections at once from one address",
        ),
        *(logs if rotating else []),
    ]


def serve(role: str, args: argparse.Namespace, token: bytes | None, agent: Agent) -> None:
    """Bind both ports on every address, print READY, serve until SIGTERM/SIGINT,
    then stop accepting and let in-flight requests finish (up to --drain-timeout)."""
    handle, status, metrics = agent.handle, agent.status, agent.stats.prometheus
    hosts = [h.strip() for h in str(args.host).split(",") if h.strip()]
    trusted = trusted_set(args.trusted_peers)
    draining = threading.Event()
    frames: list[FrameServer] = []
    controls: list[ThreadingHTTPServer] = []
    port, control_port = args.port, args.control_port
    settings = Settings(*agent.live_settings())
    try:
        for host in hosts:  # port 0: the first bind picks it, the others reuse it
            frames.append(
                FrameServer(
                    host,
                    port,
                    handle,
                    token,
                    args.handshake_timeout,
                    args.max_connections,
                    args.max_preauth_per_peer,
                    trusted,
                )
            )
            port = frames[-1].server_address[1]
            controls.append(
                start_control(
                    host,
                    control_port,
                    status,
                    metrics,
                    token,
                    draining,
                    args.handshake_timeout,
                    trusted,
                    settings,
                )
            )
            control_port = controls[-1].server_address[1]
    except OSError as e:
        fail(f"cannot listen on {host}: {e.strerror}")
    settings.add(*listener_settings(frames, controls))
    for server in frames:
        # A short poll so a SIGTERM closes the listener within a tenth of a second.
        threading.Thread(
            target=server.serve_forever, args=(0.1,), daemon=True, name="frames"
        ).start()
    ready = {
        "role": role,
        "host": hosts[0],
        "hosts": hosts,
        "port": port,
        "control_port": control_port,
        "auth": token is not None,
    }
    print("READY " + json.dumps(ready), flush=True)
    log.info(
        "serving %s on %s port %d (control %d), auth %s",
        role,
        ",".join(hosts),
        port,
        control_port,
        "on" if token else "OFF",
    )

    wait_for_signal()
    drain(role, agent, frames, controls, draining, args.drain_timeout)


def wait_for_signal() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()  # the handlers run on this thread, so the wait wakes as soon as one fires


def drain(
    role: str,
    agent: Agent,
    frames: list[FrameServer],
    controls: list[ThreadingHTTPServer],
    draining: threading.Event,
    timeout_s: float,
) -> None:
    """Stop accepting, then let in-flight requests finish for up to `timeout_s`."""

    def busy() -> int:
        return agent.stats.in_flight

    log.info("%s draining: no new connections, waiting for %d requests", role, busy())
    draining.set()
    for server in frames:
        server.shutdown()
        server.server_close()  # new connections are refused from here on
    deadline = time.monotonic() + timeout_s
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = busy()
    for c in controls:
        c.shutdown()
    if left:
        log.warning("%s stopped with %d requests still running after %.0fs", role, left, timeout_s)
    else:
        log.info("%s drained and stopped", role)

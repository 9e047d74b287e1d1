"""The control port: GET /health for anyone; /status, /metrics and /settings for
token holders, proven by challenge-response (disagg_agents.wire.httpauth) so the
token never crosses the wire; PUT /settings (a signed body) changes live settings.
The port caps its connections and bounds each request's whole life."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from disagg_agents.runtime.gate import HANDSHAKE_TIMEOUT_S, Gate
from disagg_agents.runtime.listener import FrameServer, Reaper
from disagg_agents.runtime.logs import rotating_handlers
from disagg_agents.runtime.report import StatusReport
from disagg_agents.runtime.settings import MAX_BODY_BYTES as MAX_SETTINGS_BODY
from disagg_agents.runtime.settings import Setting, Settings, SettingsError
from disagg_agents.wire.httpauth import PROOF_HEADER, ServerAuth
from disagg_agents.wire.text import printable

log = logging.getLogger("disagg.agent")

CONTROL_MAX_CONNECTIONS = 64  # HTTP control port, at once
CONTROL_MAX_PER_PEER = 16
JSON = "application/json"
UNAUTHORIZED = (
    b'{"error": "unauthorized: answer the Disagg-HMAC challenge (disagg_agents.wire.httpauth)"}'
)


@dataclass
class Endpoints:
    """What the control port answers from."""

    status: Callable[[], StatusReport]
    metrics: Callable[[], str]
    draining: threading.Event  # set: /health says 503, so routers send work elsewhere
    auth: ServerAuth | None = None  # None: no cluster token, every endpoint is open
    settings: Settings | None = None


class ControlServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # as FrameServer: a burst must not wait on SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        endpoints: Endpoints,
        deadline_s: float,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(address, ControlHandler)
        self.endpoints = endpoints
        # Every HTTP connection stays "unauthenticated" in the gate's terms.
        self.gate = Gate(
            CONTROL_MAX_CONNECTIONS, CONTROL_MAX_PER_PEER, CONTROL_MAX_CONNECTIONS, trusted
        )
        self.reaper = Reaper()
        self.deadline_s = deadline_s  # a live setting: read per connection

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


class ControlHandler(BaseHTTPRequestHandler):
    """One request on the control port; `answer` and `refuse` are how every
    endpoint replies (put_settings's too)."""

    server: ControlServer

    def setup(self) -> None:
        super().setup()
        # Per read, a live setting read per connection; the server's Reaper bounds the whole.
        self.connection.settimeout(self.server.deadline_s)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self._health()
            return
        auth = self.server.endpoints.auth
        extra: dict[str, str] = {}
        if auth is None:
            code, kind, raw = self._read()
        else:
            checked = auth.check("GET", self.path, self.headers.get("Authorization"))
            if isinstance(checked, str):
                self.refuse(auth, checked)
                return
            code, kind, raw = self._read()
            extra[PROOF_HEADER] = auth.proof("GET", self.path, *checked, code, raw)
        self.answer(code, kind, raw, extra)

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        endpoints = self.server.endpoints
        put_settings(self, endpoints.auth, endpoints.settings)

    def _health(self) -> None:
        # A draining agent says so, so routers send new work elsewhere.
        ok = not self.server.endpoints.draining.is_set()
        raw = json.dumps({"ok": ok, "draining": not ok}).encode()
        self.answer(200 if ok else 503, JSON, raw, {})

    def _read(self) -> tuple[int, str, bytes]:
        """A token holder's GET: (HTTP status, content type, body)."""
        endpoints = self.server.endpoints
        if self.path == "/status":
            return 200, JSON, json.dumps(endpoints.status().as_json()).encode()
        if self.path == "/metrics":
            return 200, "text/plain; version=0.0.4", endpoints.metrics().encode()
        if self.path == "/settings" and endpoints.settings is not None:
            return 200, JSON, json.dumps({"settings": endpoints.settings.values()}).encode()
        return 404, JSON, b'{"error": "no such endpoint"}'

    def refuse(self, auth: ServerAuth, why: str) -> None:
        """401 with a fresh challenge; logged unless it is the protocol's first step."""
        if why != "no credentials":  # a bare request is the protocol's first step
            log.warning(
                "refused HTTP %s %s from %s: %s",
                self.command,
                printable(self.path, 100),
                self.client_address[0],
                why,
            )
        self.answer(401, JSON, UNAUTHORIZED, {"WWW-Authenticate": auth.challenge()})

    def answer(self, code: int, kind: str, raw: bytes, extra: dict[str, str]) -> None:
        """The whole response: status, content type and length, `extra` headers, body."""
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(raw)))
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # health polls would drown the agent's log


def start_control(
    host: str,
    port: int,
    status: Callable[[], StatusReport],
    metrics: Callable[[], str],
    token: bytes | None,
    draining: threading.Event,
    deadline_s: float = HANDSHAKE_TIMEOUT_S,
    trusted: frozenset[str] = frozenset(),
    settings: Settings | None = None,
) -> ControlServer:
    """Bind the control port and serve it from a daemon thread."""
    auth = ServerAuth(token) if token is not None else None
    endpoints = Endpoints(status, metrics, draining, auth, settings)
    server = ControlServer((host, port), endpoints, deadline_s, trusted)
    # Polled every 0.1 s (as the frames server is), so shutdown() is not a 0.5 s wait.
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True, name="control").start()
    return server


def put_settings(
    handler: ControlHandler, auth: ServerAuth | None, settings: Settings | None
) -> None:
    """PUT /settings on the control port: the body is read (bounded) first, since the
    client's MAC covers it; only an agent with a token takes changes."""

    def error(code: int, why: str) -> None:
        handler.answer(code, JSON, json.dumps({"error": why}).encode(), {})

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
        handler.refuse(auth, checked)
        return
    code, raw = change_settings(settings, body, handler.client_address[0])
    proof = auth.proof("PUT", handler.path, *checked, code, raw)
    handler.answer(code, JSON, raw, {PROOF_HEADER: proof})


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


def listener_settings(frames: list[FrameServer], controls: list[ControlServer]) -> list[Setting]:
    """What both roles let an operator change live: the data port's caps and
    handshake deadline (new connections), the log's rotation size."""
    return [_handshake_setting(frames, controls), *_gate_settings(frames), *_log_settings()]


def _handshake_setting(frames: list[FrameServer], controls: list[ControlServer]) -> Setting:
    """One deadline for both ports: a new connection's handshake, an HTTP request."""

    def apply(v: float) -> None:
        for f in frames:
            f.handshake_timeout_s = v
        for c in controls:
            c.deadline_s = v

    return Setting(
        "handshake_timeout_s",
        float,
        lambda: frames[0].handshake_timeout_s,
        apply,
        0.1,
        600.0,
        "seconds a new connection has to authenticate",
    )


def _gate_settings(frames: list[FrameServer]) -> list[Setting]:
    """The data port's gate caps; max_connections also sets the unauthenticated half."""

    def caps(**shares: int) -> Callable[[int], None]:
        def apply(v: int) -> None:
            for f in frames:
                with f.gate.lock:
                    for name, share in shares.items():
                        setattr(f.gate, name, max(1, v // share))

        return apply

    gate = frames[0].gate
    return [
        Setting(
            "max_connections",
            int,
            lambda: gate.total,
            caps(total=1, preauth_total=2),
            2,
            1 << 16,
            "connections at once on the data port (half at most unauthenticated)",
        ),
        Setting(
            "max_preauth_per_peer",
            int,
            lambda: gate.preauth_per_peer,
            caps(preauth_per_peer=1),
            1,
            1 << 16,
            "unauthenticated connections at once from one address",
        ),
    ]


def _log_settings() -> list[Setting]:
    """--log-file's rotation size; nothing for an agent logging to stderr."""
    rotating = rotating_handlers()
    if not rotating:
        return []

    def rotate_at(v: int) -> None:
        for h in rotating:
            h.maxBytes = v

    return [
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

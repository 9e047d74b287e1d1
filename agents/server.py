"""What both agents share: a threaded TCP listener for frames, a small HTTP
control endpoint (GET /health, GET /status), and the READY line that tells
whoever started the agent which ports it got."""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

from . import protocol as P

log = logging.getLogger("disagg.agent")


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {role} %(levelname)s %(message)s",
    )


HANDSHAKE_TIMEOUT_S = 10.0  # a peer that connects and says nothing is dropped after this
IDLE_TIMEOUT_S = 600.0  # an open connection with no request for this long is closed


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
        default=P.CONTROL_MAX_FRAME,
        help="largest control frame (request, hello) accepted from a peer",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    return p


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
    if len(token) < 16:
        fail(f"token file {path} holds no usable token (at least 16 characters)")
    return token


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
    ) -> None:
        class _Handler(socketserver.BaseRequestHandler):
            def handle(inner) -> None:
                sock: socket.socket = inner.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = f"{inner.client_address[0]}:{inner.client_address[1]}"
                try:
                    sock.settimeout(HANDSHAKE_TIMEOUT_S)
                    P.server_auth(sock, token)
                    sock.settimeout(IDLE_TIMEOUT_S)
                except P.AuthError as e:
                    log.warning("refused %s: %s", peer, e)
                    return
                except (OSError, P.ProtocolError) as e:
                    log.info("dropped %s before it authenticated: %s", peer, e)
                    return
                try:
                    handle(sock, peer)
                except Exception:  # a bad connection must never take the agent down
                    log.exception("connection from %s failed", peer)

        super().__init__((host, port), _Handler)


def start_control(
    host: str,
    port: int,
    status: Callable[[], dict[str, Any]],
    metrics: Callable[[], str],
    token: bytes | None,
    draining: threading.Event,
) -> ThreadingHTTPServer:
    class _Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            kind = "application/json"
            if self.path == "/health":
                # A draining agent says so, so routers send new work elsewhere.
                ok = not draining.is_set()
                raw, code = json.dumps({"ok": ok, "draining": not ok}).encode(), 200 if ok else 503
            elif not self._authorized():
                log.warning(
                    "refused HTTP %s from %s: bad or missing bearer token",
                    self.path,
                    self.client_address[0],
                )
                raw, code = b'{"error": "unauthorized: send Authorization: Bearer TOKEN"}', 401
            elif self.path == "/status":
                raw, code = json.dumps(status()).encode(), 200
            elif self.path == "/metrics":
                raw, code = metrics().encode(), 200
                kind = "text/plain; version=0.0.4"
            else:
                raw, code = json.dumps({"error": f"no such endpoint {self.path}"}).encode(), 404
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _authorized(self) -> bool:
            if token is None:
                return True
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            return hmac.compare_digest(given.encode(), token)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # health polls would drown the agent's log

    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="control").start()
    return server


def serve(
    role: str,
    args: argparse.Namespace,
    token: bytes | None,
    handle: Callable[[socket.socket, str], None],
    status: Callable[[], dict[str, Any]],
    metrics: Callable[[], str],
    busy: Callable[[], int],
) -> None:
    """Bind both ports on every address, print READY, serve until SIGTERM/SIGINT,
    then stop accepting and let in-flight requests finish (up to --drain-timeout)."""
    hosts = [h.strip() for h in str(args.host).split(",") if h.strip()]
    P.CONTROL_MAX_FRAME = args.max_request_bytes  # what any peer may make us allocate at once
    draining = threading.Event()
    frames: list[FrameServer] = []
    controls: list[ThreadingHTTPServer] = []
    port, control_port = args.port, args.control_port
    try:
        for host in hosts:  # port 0: the first bind picks it, the others reuse it
            frames.append(FrameServer(host, port, handle, token))
            port = frames[-1].server_address[1]
            controls.append(start_control(host, control_port, status, metrics, token, draining))
            control_port = controls[-1].server_address[1]
    except OSError as e:
        fail(f"cannot listen on {host}: {e.strerror}")
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

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()  # the handlers run on this thread, so the wait wakes as soon as one fires
    log.info("%s draining: no new connections, waiting for %d requests", role, busy())
    draining.set()
    for server in frames:
        server.shutdown()
        server.server_close()  # new connections are refused from here on
    deadline = time.monotonic() + args.drain_timeout
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = busy()
    for c in controls:
        c.shutdown()
    if left:
        log.warning(
            "%s stopped with %d requests still running after %.0fs", role, left, args.drain_timeout
        )
    else:
        log.info("%s drained and stopped", role)

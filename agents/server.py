"""What both agents share: a threaded TCP listener for frames, a small HTTP
control endpoint (GET /health, GET /status), and the READY line that tells
whoever started the agent which ports it got."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import socketserver
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("disagg.agent")


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {role} %(levelname)s %(message)s",
    )


def fail(message: str) -> None:
    """Exit with one line the launcher can show to the user as is."""
    print(f"FAILED {message}", flush=True)
    log.error("%s", message)
    raise SystemExit(1)


def common_args(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m agents.{role}")
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (both ports)")
    p.add_argument("--port", type=int, default=0, help="KV/data TCP port (0: any free)")
    p.add_argument("--control-port", type=int, default=0, help="HTTP control port (0: any free)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, or a framework device name")
    p.add_argument("--name", default=None, help="how this agent names itself in metrics")
    return p


class FrameServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, handle: Callable[[socket.socket, str], None]):
        self.handle_conn = handle

        class _Handler(socketserver.BaseRequestHandler):
            def handle(inner) -> None:
                sock: socket.socket = inner.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = f"{inner.client_address[0]}:{inner.client_address[1]}"
                try:
                    handle(sock, peer)
                except Exception:  # a bad connection must never take the agent down
                    log.exception("connection from %s failed", peer)

        super().__init__((host, port), _Handler)


def start_control(
    host: str, port: int, status: Callable[[], dict[str, Any]], metrics: Callable[[], str]
) -> ThreadingHTTPServer:
    class _Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            kind = "application/json"
            if self.path == "/health":
                raw, code = b'{"ok": true}', 200
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

        def log_message(self, format: str, *args: Any) -> None:
            pass  # health polls would drown the agent's log

    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="control").start()
    return server


def serve(
    role: str,
    host: str,
    port: int,
    control_port: int,
    handle: Callable[[socket.socket, str], None],
    status: Callable[[], dict[str, Any]],
    metrics: Callable[[], str],
) -> None:
    """Bind both ports, print the READY line, serve until SIGTERM/SIGINT."""
    frames = FrameServer(host, port, handle)
    control = start_control(host, control_port, status, metrics)
    ready = {
        "role": role,
        "host": host,
        "port": frames.server_address[1],
        "control_port": control.server_address[1],
    }
    print("READY " + json.dumps(ready), flush=True)
    log.info("serving %s on %s:%d (control %d)", role, host, ready["port"], ready["control_port"])

    def _stop(signum: int, frame: Any) -> None:
        threading.Thread(target=frames.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    frames.serve_forever()
    control.shutdown()
    log.info("%s stopped", role)

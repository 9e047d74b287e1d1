"""/api/show's model description: a failed status fetch is never kept, so the
first answer after an agent comes up is already right (continue.dev reads it
once). A real socket: first nothing listens, then a /status server does."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from disagg.api import Client
from disagg.frontends.agentinfo import ModelInfo
from disagg.serving.router import Endpoint, Route, Router
from disagg_agents.wire.status import ChatFacts

STATUS = {"chat": {"capabilities": ["completion", "tools"], "template": "{{ messages }}"}}


class Status(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps(STATUS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_failed_fetch_is_not_kept() -> None:
    with socket.socket() as probe:  # a port nothing listens on (yet)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = Endpoint("d0", "127.0.0.1", 1, control_port=port)
    info = ModelInfo(Client(router=Router([Route("m", [], [agent])])))
    assert info.get("m").status.doc == {}
    server = ThreadingHTTPServer(("127.0.0.1", port), Status)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        assert info.get("m").status.doc == STATUS  # asked again, not the failure kept
        chat = info.get("m").status.chat  # and now kept, typed
        assert chat == ChatFacts(capabilities=("completion", "tools"), template="{{ messages }}")
    finally:
        server.shutdown()
        server.server_close()

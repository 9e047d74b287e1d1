"""The wire bench's receiving process, started by `handoff.Receiver` (as the decode
agent, a process of its own): one transfer per job line on stdin, one answer line
on stdout. Our KV_LAYER frames into numpy, into mlx caches (`handoffmlx`), a bare
socket (pushed, or asked with a PREFILL first), or JSON + base64 over HTTP.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import numpy as np

from disagg.bench.handoff import ACK, Spec, kv_digest
from disagg_agents.wire.channel import FrameReader
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.kvcodec import WIRE_NUMPY, DType, Kind, LayerKV, decode_layer
from disagg_agents.wire.request import PrefillRequest


def _recv_ours(sock: socket.socket, verify: bool) -> str | None:
    h = hashlib.sha256() if verify else None
    reader = FrameReader(sock)  # as disagg_agents.decode.kvfetch receives
    while True:
        header, payload = reader.read()
        if header.type == Frame.PREFILL_DONE:
            break
        kv = decode_layer(payload)
        if h is not None:
            h.update(kv.keys.tobytes())
            h.update(kv.values.tobytes())
    return h.hexdigest() if h else None


def _recv_bare(sock: socket.socket, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"closed after {got} of {len(buf)} bytes")
        got += n


def _json_layers(body: bytes) -> list[LayerKV]:
    doc = json.loads(body)
    out = []
    for item in doc["layers"]:
        dt = DType[item["dtype"]]
        np_dtype = WIRE_NUMPY[dt]
        keys = np.frombuffer(base64.b64decode(item["k"]), np_dtype).reshape(item["k_shape"])
        values = np.frombuffer(base64.b64decode(item["v"]), np_dtype).reshape(item["v_shape"])
        out.append(LayerKV(item["layer"], Kind(item["kind"]), dt, keys, values))
    return out


class _JsonHandler(BaseHTTPRequestHandler):
    result: list[str | None] = [None]
    verify = False

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        layers = _json_layers(body)
        type(self).result[0] = kv_digest(layers) if type(self).verify else None
        self.send_response(200)
        self.send_header("Content-Length", "1")
        self.end_headers()
        self.wfile.write(ACK)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    """Child process: one transfer per job line on stdin, one answer line on stdout."""
    tcp = socket.create_server(("127.0.0.1", 0))
    httpd = HTTPServer(("127.0.0.1", 0), _JsonHandler)

    def answer(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer([tcp.getsockname()[1], httpd.server_address[1]])
    mlx_rx: Any = None
    for line in sys.stdin:
        job = json.loads(line)
        mode, total, verify = job[:3]
        digest: str | None = None
        if mode in ("inplace", "mlx_copy"):  # into mlx caches, as the decode agent
            from disagg.bench.handoffmlx import MlxReceiver

            mlx_rx = mlx_rx or MlxReceiver()
            transfer = mlx_rx.prepare(mode, Spec(**job[3]))  # allocates before the clock
            answer("ready")
            sock, _ = tcp.accept()
            with sock:
                sock.settimeout(60.0)  # as kvfetch.open_session: the agent's has a timeout
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                got = transfer.receive(sock, verify)
                sock.sendall(ACK)
            del transfer
            answer(got)
            continue
        if mode == "json":
            _JsonHandler.verify = verify
            answer("ready")
            httpd.handle_request()
            digest = _JsonHandler.result[0]
        else:
            buf = bytearray(total) if mode in ("bare", "bare_asked") else bytearray()
            if mode == "bare_asked":  # as handoffmlx's, made before the clock
                from disagg_agents.decode.kvfetch import send_prefill  # mlx: only in the receiver

                request = PrefillRequest(list(range(Spec(**job[3]).tokens)))
            answer("ready")
            sock, _ = tcp.accept()
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if mode == "bare_asked":
                    sock.settimeout(60.0)  # as the in-place receiver, up to its PREFILL
                    send_prefill(sock, request, True)  # as kvfetch.receive_layers
                if mode == "ours":
                    digest = _recv_ours(sock, verify)
                else:
                    _recv_bare(sock, buf)
                sock.sendall(ACK)
            del buf
        answer(digest)
    if mlx_rx is not None:
        mlx_rx.close()
    tcp.close()
    httpd.server_close()

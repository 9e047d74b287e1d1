"""The wire bench's sending side: `Receiver` starts the receiving process (as the
decode agent, a process of its own: `handoffrecv`) and hands it the same K/V
several ways: our KV_LAYER frames (into numpy; or into mlx caches as the decode
agent takes them, in place or by the copy path: `handoffmlx`), a bare socket,
and JSON + base64 over HTTP. Each is
timed from an open connection to the receiver's one-byte ack after its last
array exists.

The bare socket runs two ways: pushing the moment its connection is open, and
asked: the receiver first sends the PREFILL frame the decode agent would (the
same bytes, built the same way), the sender reads it whole and only then pushes,
as the in-place path waits for its PREFILL. On the 2-core VM it was built on,
the asked push streamed 10-20 % faster than the unasked one (whose receiver is
still waking from `accept` under its first sends), so it is the harder baseline;
the issue's bar stays on the unasked push."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from disagg_agents.wire.channel import recv_control, recv_exact
from disagg_agents.wire.frames import Frame, split_json_ids
from disagg_agents.wire.kvcodec import Codec, LayerKV
from disagg_agents.wire.request import PrefillRequest

ACK = b"k"
# The LOGITS frame receive_layers waits for before PREFILL_DONE (any length).
LOGITS = np.zeros(64, np.float32).tobytes()
DONE = b'{"layers":0}'  # a PREFILL_DONE: JSON
RECEIVER_CODE = "from disagg.bench.handoffrecv import main; main()"


@dataclass(frozen=True)
class Spec:
    """The K/V the sender will send: the receiver's caches are made to fit it."""

    layers: int
    tokens: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    heads: int
    dim: int

    @classmethod
    def of(cls, layers: list[LayerKV]) -> Spec:
        heads, tokens, dim = layers[0].keys.shape
        return cls(len(layers), int(tokens), layers[0].dtype.name.lower(), heads, dim)


def kv_digest(layers: Iterable[LayerKV]) -> str:
    h = hashlib.sha256()
    for kv in layers:
        h.update(np.ascontiguousarray(kv.keys).tobytes())
        h.update(np.ascontiguousarray(kv.values).tobytes())
    return h.hexdigest()


def raw_size(layers: list[LayerKV]) -> int:
    return sum(kv.keys.nbytes + kv.values.nbytes for kv in layers)


class Receiver:
    """The receiving side in its own process (as the decode agent is)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.tcp_port, self.http_port = self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver process exited with {self.proc.wait()}")
        return json.loads(line)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def _start(
        self, mode: str, total: int, verify: bool, spec: dict[str, Any] | None = None
    ) -> None:
        assert self.proc.stdin is not None
        job = [mode, total, verify] if spec is None else [mode, total, verify, spec]
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        if self._read() != "ready":
            raise RuntimeError("the receiver did not get ready")

    def _dial(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.tcp_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def ours(
        self, layers: list[LayerKV], codec: Codec = Codec.RAW, verify: bool = False
    ) -> tuple[float, int, str | None]:
        """Seconds, bytes on the wire, and (with verify) the receiver's digest."""
        self._start("ours", 0, verify)
        with self._dial() as sock:
            t0 = time.perf_counter()
            sender = _send_layers(sock, layers, codec, ((Frame.PREFILL_DONE, DONE),))
            ack = recv_exact(sock, 1)
            secs = time.perf_counter() - t0
            _finish(sender, ack)
        return secs, sender.bytes, self._read()

    def into_mlx(
        self,
        layers: list[LayerKV],
        inplace: bool = True,
        codec: Codec = Codec.RAW,
        verify: bool = False,
    ) -> tuple[float, int, dict[str, Any]]:
        """Into the receiver's mlx caches as the decode agent takes them (in place,
        or the copy path): seconds, bytes on the wire, and the receiver's answer
        (digest with verify, layers placed in place, its allocation's seconds),
        and the seconds until the sender had the PREFILL (`request_s`)."""
        self._start("inplace" if inplace else "mlx_copy", 0, verify, asdict(Spec.of(layers)))
        with self._dial() as sock:
            t0 = time.perf_counter()
            # As the prefill agent: the decode side asks (PREFILL, its ids packed
            # as HELLO_OK offers), read and checked as the agent does; then the
            # stream, LOGITS and PREFILL_DONE through the agent's sender.
            header, payload = recv_control(sock, Frame.PREFILL)
            frame, packed = split_json_ids(header, payload)
            PrefillRequest.from_dict(frame, None, packed)
            asked = time.perf_counter() - t0  # the request's round trip, in the time
            frames = ((Frame.LOGITS, LOGITS), (Frame.PREFILL_DONE, DONE))
            sender = _send_layers(sock, layers, codec, frames)
            ack = recv_exact(sock, 1)
            secs = time.perf_counter() - t0
            _finish(sender, ack)
        got: dict[str, Any] = self._read()
        return secs, sender.bytes, {**got, "request_s": asked}

    def bare(self, layers: list[LayerKV], asked: bool = False) -> float:
        """Seconds for the raw K and V buffers through a bare socket; `asked`:
        only once the receiver's PREFILL frame is read (not parsed)."""
        if asked:
            self._start("bare_asked", raw_size(layers), False, asdict(Spec.of(layers)))
        else:
            self._start("bare", raw_size(layers), False)
        with self._dial() as sock:
            t0 = time.perf_counter()
            if asked:
                recv_control(sock, Frame.PREFILL)
            for kv in layers:
                sock.sendall(memoryview(kv.keys).cast("B"))  # type: ignore[arg-type]
                sock.sendall(memoryview(kv.values).cast("B"))  # type: ignore[arg-type]
            if recv_exact(sock, 1) != ACK:
                raise RuntimeError("bad ack")
            secs = time.perf_counter() - t0
        self._read()
        return secs

    def json(self, layers: list[LayerKV], verify: bool = False) -> tuple[float, int, str | None]:
        self._start("json", 0, verify)
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=600)
        conn.connect()
        try:
            t0 = time.perf_counter()
            body = json.dumps(
                {
                    "layers": [
                        {
                            "layer": kv.layer,
                            "kind": int(kv.kind),
                            "dtype": kv.dtype.name,
                            "k_shape": list(kv.keys.shape),
                            "v_shape": list(kv.values.shape),
                            "k": base64.b64encode(kv.keys.tobytes()).decode("ascii"),
                            "v": base64.b64encode(kv.values.tobytes()).decode("ascii"),
                        }
                        for kv in layers
                    ]
                }
            ).encode()
            conn.request("POST", "/kv", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200 or resp.read() != ACK:
                raise RuntimeError(f"json receiver answered {resp.status}")
            secs = time.perf_counter() - t0
        finally:
            conn.close()
        return secs, len(body), self._read()


def _send_layers(
    sock: socket.socket,
    layers: list[LayerKV],
    codec: Codec,
    frames: tuple[tuple[Frame, bytes], ...] = (),
) -> Any:
    """The layers, then `frames`, queued on the prefill agent's own LayerSender,
    which sends them from its thread; `_finish` it once the receiver acked.

    The clock stops at the ack, which only comes once every frame arrived: the
    sender's close (three thread wake-ups, milliseconds each on a busy box) is not
    part of the handoff, as it is not in the agent, where the decode side starts
    on PREFILL_DONE whatever the sending thread does next."""
    from disagg_agents.prefill.sender import LayerSender  # imports torch: only in the sender

    sender = LayerSender(sock, codec)
    for kv in layers:
        sender.put(kv)
    for ftype, payload in frames:
        sender.put_frame(ftype, payload)
    return sender


def _finish(sender: Any, ack: bytes | bytearray) -> None:
    """Close the sender; raise its error, or a bad ack's."""
    sender.close()
    if sender.error is not None:
        raise sender.error
    if ack != ACK:
        raise RuntimeError("bad ack")

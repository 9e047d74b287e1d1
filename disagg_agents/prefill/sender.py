"""The sending side of a K/V stream: layers queued as they are computed and sent
by a pooled thread, bounded in bytes and in how long a peer may stall."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from disagg_agents.runtime.daemonpool import DaemonPool
from disagg_agents.wire.channel import (
    OutFrame,
    out_frame,
    send_out,
)
from disagg_agents.wire.frames import (
    Frame,
)
from disagg_agents.wire.kvcodec import (
    Codec,
    LayerKV,
    QuantKV,
    block_bytes,
    decode_layer,
    encode_layer,
    quantize_layer,
)

log = logging.getLogger("disagg.prefill")


class PeerStalled(Exception):
    """The peer stopped taking its K/V: its connection is cut, nobody else waits."""


KV_BUFFER_MB = 4096  # per connection: raw K/V computed and not yet on the wire
KV_STALL_S = 60.0  # a peer that takes no K/V bytes for this long is cut off
# A frame's bytes, or what makes them when the frames before it are sent.
FramePayload = bytes | Callable[[], bytes]


@dataclass(frozen=True, slots=True)
class _Layer:
    """A layer queued to send: its frame made already when that reads no bytes
    (raw, lossless, contiguous: only views), else made by the sending thread."""

    kv: LayerKV
    frame: OutFrame | None
    nbytes: int  # raw K/V bytes


# The threads LayerSenders send from (disagg_agents.runtime.daemonpool: reused, never queued).
SENDERS = DaemonPool("kv-sender")


class LayerSender:
    """Sends KV_LAYER frames from its own thread so the socket overlaps compute.

    Counts the raw (model dtype) K/V bytes and the time spent encoding them.
    With `kv_quant` "int8" each layer is quantized first (lossy; timed apart in
    `quant_s`, so `encode_s` stays the codec's own time). With `probe_layer`,
    that layer is also encoded and decoded once with every other compressing
    codec after it is sent, and the sizes and times are kept in `probe` for the
    decode side's codec choice (disagg_agents.decode.codectuner).

    `put` never waits on the socket (it runs inside the forward pass): layers
    queue here, at most `max_buffer_bytes` of them, and a peer that lets more
    pile up, or takes no bytes for `stall_s`, is cut off
    (PeerStalled), which ends that request only.
    """

    def __init__(
        self,
        sock: socket.socket,
        codec: Codec,
        probe_layer: int | None = None,
        kv_quant: str | None = None,
        max_buffer_bytes: int = KV_BUFFER_MB << 20,
        stall_s: float = KV_STALL_S,
    ) -> None:
        self.sock = sock
        self.codec = codec
        self.kv_quant = kv_quant
        self.probe_layer = probe_layer
        self.probe: dict[str, dict[str, float]] = {}
        self.max_buffer_bytes = max_buffer_bytes
        self.stall_s = stall_s
        self.q: queue.SimpleQueue[_Layer | tuple[Frame, FramePayload] | None] = queue.SimpleQueue()
        self.cond = threading.Condition()  # guards the counts below; never held over I/O
        self.buffered = 0  # raw K/V bytes put and not yet sent
        self.queued = 0  # items put and not yet sent (or dropped)
        # Monotonic time the send under way began or last got bytes out (None: idle).
        self.sending_since: float | None = None
        self.bytes = 0
        self.raw_bytes = 0
        self.encode_s = 0.0
        self.quant_s = 0.0
        self.closed = False
        self.error: BaseException | None = None
        self.done = SENDERS.run(self._run)  # set once the sending thread is through

    def put(self, kv: LayerKV) -> None:
        """Queue one layer; raises the sender's error (so a failed or stalled
        peer's forward pass stops at once and frees the device)."""
        n = kv.keys.nbytes + kv.values.nbytes
        frame = self._early_frame(kv)  # raises before anything is counted
        with self.cond:
            if self.error is None and self.buffered and self.buffered + n > self.max_buffer_bytes:
                self._stalled(f"{self.buffered} bytes of K/V waiting for it")
            elif self.error is None and self.stalled_s() >= self.stall_s:
                self._stalled(f"it took no K/V for {self.stall_s:.0f}s")
            if self.error is not None:
                raise self.error
            self.buffered += n
            self.queued += 1
            idle = self.queued == 1
        self.q.put(_Layer(kv, frame, n))
        if idle:
            # Hand the GIL to the sending thread now: a producer that puts layers
            # back to back (a prefix hit, a bench) would otherwise hold it until it
            # blocks, and the wire would wait ~15 us a layer (2 % of a bf16 handoff).
            time.sleep(0)

    def _early_frame(self, kv: LayerKV) -> OutFrame | None:
        """The layer's frame made here, on the producer's thread, where it costs
        the wire nothing (see protocol.OutFrame); None: the sending thread makes
        it (compressing or quantizing reads the bytes, which a device-to-host
        copy may still be writing)."""
        if self.codec != Codec.RAW or self.kv_quant:
            return None
        if not (kv.keys.flags.c_contiguous and kv.values.flags.c_contiguous):
            return None  # made contiguous by a copy, which reads them
        t0 = time.perf_counter()
        frame = out_frame(Frame.KV_LAYER, encode_layer(kv, Codec.RAW))
        self.encode_s += time.perf_counter() - t0
        return frame

    def put_frame(self, ftype: Frame, payload: FramePayload) -> None:
        """Queue a frame to follow the layers (LOGITS, PREFILL_DONE). A callable
        payload is made by the sending thread when the frames before it are sent
        (PREFILL_DONE's counts), sparing a round trip between the two threads."""
        with self.cond:
            if self.error is not None:
                raise self.error
            self.queued += 1
        self.q.put((ftype, payload))

    def stalled_s(self) -> float:
        """How long the send under way has got no bytes out (0: none under way)."""
        since = self.sending_since
        return 0.0 if since is None else time.monotonic() - since

    def _stalled(self, why: str) -> None:
        """Cut the peer off (called with `cond` held): shutdown wakes the send."""
        self.error = PeerStalled(f"peer stopped reading: {why}")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.cond.notify_all()

    def drain(self) -> None:
        """Wait until all that was put is on the wire; raises the sender's
        error, cutting the peer off if it takes no bytes for `stall_s`."""
        with self.cond:
            while self.queued and self.error is None:
                left = self.stall_s - self.stalled_s()
                if left <= 0:
                    self._stalled(f"it took no K/V for {self.stall_s:.0f}s")
                    break
                self.cond.wait(left)
            if self.error is not None:
                raise self.error

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            n = item.nbytes if isinstance(item, _Layer) else 0
            try:
                if self.error is not None:
                    continue  # drain: the peer is gone
                if isinstance(item, _Layer):
                    self._send_layer(item)
                else:
                    ftype, payload = item
                    self._send(out_frame(ftype, payload() if callable(payload) else payload))
            except Exception as e:  # OSError: the peer is gone; else a bug, sent as ERROR
                with self.cond:
                    if self.error is None:
                        self.error = e
            finally:
                with self.cond:
                    self.sending_since = None
                    self.buffered -= n
                    self.queued -= 1
                    # drain() waits for an empty queue (or an error): waking it
                    # per layer only takes the GIL back and forth with this thread.
                    if not self.queued or self.error is not None:
                        self.cond.notify_all()

    def _send(self, frame: OutFrame) -> int:
        self.sending_since = time.monotonic()
        sent = send_out(self.sock, frame, progress=self._progress)
        self.sending_since = None
        return sent

    def _progress(self) -> None:
        # A slow link that keeps taking bytes is not stalled, however long a frame.
        self.sending_since = time.monotonic()

    def _send_layer(self, layer: _Layer) -> None:
        kv, frame = layer.kv, layer.frame
        kv.wait()  # a device-to-host copy may still be under way
        wire: LayerKV | QuantKV = kv
        if frame is None:
            t0 = time.perf_counter()
            wire = quantize_layer(kv) if self.kv_quant else kv
            t1 = time.perf_counter()
            frame = out_frame(Frame.KV_LAYER, encode_layer(wire, self.codec))
            self.quant_s += t1 - t0
            self.encode_s += time.perf_counter() - t1
        self.raw_bytes += layer.nbytes
        self.bytes += self._send(frame)
        if kv.layer == self.probe_layer:
            self._probe(wire)

    def _probe(self, kv: LayerKV | QuantKV) -> None:
        raw = block_bytes(kv)  # what the codec compresses: int8 blocks when quantized
        for codec in Codec:
            if codec in (Codec.RAW, self.codec):
                continue  # the codec in use is measured on every layer anyway
            t0 = time.perf_counter()
            parts = encode_layer(kv, codec)
            t1 = time.perf_counter()
            decode_layer(b"".join(parts))
            t2 = time.perf_counter()
            wire = sum(memoryview(p).nbytes for p in parts[1:])
            self.probe[str(int(codec))] = {
                "raw_bytes": raw,
                "wire_bytes": wire,
                "encode_s": t1 - t0,
                "decode_s": t2 - t1,
            }

    def close(self) -> None:
        """Finish sending (a stalled peer is cut off) and stop the thread."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self.drain()
            self.q.put(None)
            self.done.wait()

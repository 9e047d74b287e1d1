"""The decode side of a prefill connection: dial, handshake, receive the prompt's
K/V layer by layer straight into mlx caches."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from disagg_agents.decode.codectuner import MIN_LINK_FRAME
from disagg_agents.decode.kvcaches import check_layer, fill_layer
from disagg_agents.decode.kvslots import Slots, receive_layer
from disagg_agents.prefix.store import Prefix
from disagg_agents.runtime.hangup import HungUp
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import FrameReader, recv_json, send_json, send_json_ids
from disagg_agents.wire.frames import (
    CONTROL_MAX_FRAME,
    HEADER,
    Frame,
    Header,
    PeerAuthError,
    ProtocolError,
    RemoteError,
    decode_json,
    error_from,
    packed_ids_offered,
)
from disagg_agents.wire.kvcodec import (
    LAYER_HEADER,
    Kind,
    LayerKV,
    block_bytes,
    decode_layer,
    layer_cap,
)
from disagg_agents.wire.request import PrefillRequest, PrefillTarget, pack_ids
from disagg_agents.wire.text import printable

# Puts one received layer into its cache: fill_layer itself, or a hand-off of a
# copy to the thread that owns mlx (the reader's buffer is reused for the next).
Place = Callable[[Any, LayerKV, int], None]
# The request's caches allocated for receiving in place (disagg_agents.decode.kvslots),
# asked for when the first layer arrives (the mlx thread allocates meanwhile).
SlotsSource = Callable[[], Slots]


@dataclass
class Into:
    """Where a PREFILL's K/V goes: the request's caches (one per layer), how a
    layer is placed in one, the prefix this side holds (asked only for the rest),
    and the slots a layer that fits is received into in place. `gone()` true: the
    client we fetch for hung up (await_frame)."""

    caches: list[Any]
    place: Place = fill_layer
    prefix: Prefix | None = None
    slots: SlotsSource | None = None
    gone: Callable[[], bool] | None = None


FALLBACK_KINDS = ("unreachable", "timeout", "stream", "prefill_error")
DEFAULT_TIMEOUT_S = 60.0  # a target's timeout when it sets none
GONE_POLL_S = 0.2  # how often a wait for the next frame asks whether our client left


class PrefillUnavailable(Exception):
    """The prefill agent could not be reached or dropped the stream: fall back.
    `kind`, one of FALLBACK_KINDS, is the reason as a metric label."""

    def __init__(self, message: str, kind: str = "stream") -> None:
        super().__init__(message)
        self.kind = kind


def dial(hosts: list[str], port: int, timeout_s: float) -> tuple[socket.socket, str, list[str]]:
    """Connect to the first address that answers; also return why the others failed."""
    failures: list[str] = []
    for host in hosts:
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout_s, 5.0))
            return sock, host, failures
        except OSError as e:
            failures.append(f"{host}:{port}: {e}")
    raise PrefillUnavailable(
        f"cannot reach prefill agent at {'; '.join(failures) or 'no address'}", "unreachable"
    )


@dataclass
class PrefillLink:
    """An open, authenticated connection to a prefill agent that took our HELLO."""

    sock: socket.socket
    addr: str
    hello_ok: dict[str, Any]
    failures: list[str]  # addresses tried first that did not answer


@dataclass
class Received:
    """What one PREFILL's stream delivered, beyond the K/V placed in the caches."""

    logits: np.ndarray
    done: dict[str, Any]  # the PREFILL_DONE frame
    t_sent: float  # perf_counter when the PREFILL went out
    first: float | None  # ... when the first and the last layer were placed
    last: float | None
    metrics: dict[str, Any] = field(default_factory=dict)


def open_session(target: PrefillTarget, hello: dict[str, Any], token: bytes | None) -> PrefillLink:
    """Dial the target's addresses in order, prove ourselves, and say HELLO."""
    timeout_s = target.timeout or DEFAULT_TIMEOUT_S
    sock, host, failures = dial(target.hosts, target.port, timeout_s)
    try:
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_auth(sock, token, target.integrity)
        send_json(sock, Frame.HELLO, hello)
        _, ok = recv_json(sock, Frame.HELLO_OK)
    except BaseException:
        sock.close()
        raise
    return PrefillLink(sock, f"{host}:{target.port}", ok, failures)


def send_prefill(sock: socket.socket, request: PrefillRequest, packed_ids: bool) -> None:
    """The PREFILL frame; `packed_ids`: its ids as uint32s (protocol.IDS_U32)."""
    if packed_ids:
        send_json_ids(sock, Frame.PREFILL, request.to_wire(True), pack_ids(request.token_ids))
    else:
        send_json(sock, Frame.PREFILL, request.to_wire())


def await_frame(sock: socket.socket, gone: Callable[[], bool] | None) -> None:
    """Until the next frame's first byte is here, within the socket's timeout
    (TimeoutError); HungUp as soon as `gone()` says our own client left (the
    connection then closes, and the prefill agent drops the prompt)."""
    if gone is None:
        return
    timeout_s = sock.gettimeout()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not select.select([sock], [], [], GONE_POLL_S)[0]:
        if gone():
            raise HungUp("the client hung up while its prompt waited for the prefill agent")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("timed out")


def receive_layers(
    sock: socket.socket,
    request: PrefillRequest,
    into: Into,
    fingerprint: dict[str, Any],
    vocab_size: int | None,
    packed_ids: bool = False,
) -> Received:
    """Send the PREFILL and take its stream: each layer checked and placed as it
    arrives, then the last position's logits and PREFILL_DONE. With `into.slots`, a
    layer that fits lands in its cache's memory as it is read (then `place`
    gets views of it, in slots.placed); otherwise the reader's buffer is
    decoded and `place` copies out. `packed_ids`: the prefill agent's HELLO_OK
    offered frames.IDS_U32."""
    stream = LayerStream(request, into, fingerprint, vocab_size)
    caches = into.caches
    send_prefill(sock, request, packed_ids)
    t_sent = time.perf_counter()
    # One buffer for every layer: fill_layer copies out.
    reader = FrameReader(sock, stream.max_frame)
    logits: np.ndarray | None = None
    while True:
        await_frame(sock, into.gone)
        header = reader.next()
        if header.type == Frame.KV_LAYER:
            stream.take(reader, header)
            continue
        payload = reader.buffer(header.length)
        reader.read_into(payload)
        reader.finish()
        if header.type == Frame.LOGITS:
            logits = stream.logits(payload)
        elif header.type == Frame.PREFILL_DONE:
            done = decode_json(header, bytes(payload))
            break
        elif header.type == Frame.ERROR:
            raise error_from(header, payload)
        else:
            raise ProtocolError(f"unexpected {header.type.name} during KV stream")
    if len(stream.got) != len(caches) or logits is None:
        raise ProtocolError(
            f"prefill sent {len(stream.got)} of {len(caches)} layers, "
            f"{'no' if logits is None else ''} logits"
        )
    return Received(logits, done, t_sent, stream.first, stream.last, stream.m)


class LayerStream:
    """One PREFILL's K/V layers as they arrive: each checked against the prompt
    and the fingerprint, placed in its cache, and counted."""

    def __init__(
        self,
        request: PrefillRequest,
        into: Into,
        fingerprint: dict[str, Any],
        vocab_size: int | None,
    ) -> None:
        self.request, self.caches, self.place = request, into.caches, into.place
        self.prefix, self.slots = into.prefix, into.slots
        self.into: Slots | None = None
        self.vocab_size = vocab_size
        self.n = len(request.token_ids)
        self.m: dict[str, Any] = {
            "kv_bytes": 0,
            "kv_payload_bytes": 0,  # K/V blocks as sent (compressed or not)
            "kv_raw_bytes": 0,  # K/V blocks expanded (int8 rows + scales when quantized)
            "kv_quant": None,  # how the layers arrived: None lossless, "int8"
            "kv_decode_time": 0.0,  # decode_layer: decompress + unshuffle (+ dequantize)
            "kv_link_bytes": 0,  # large frames only: see disagg_agents.decode.codectuner
            "kv_link_time": 0.0,
        }
        self.first: float | None = None
        self.last: float | None = None
        self.got: set[int] = set()
        self.heads, self.head_dim = int(fingerprint["num_kv_heads"]), int(fingerprint["head_dim"])
        # What one layer of this prompt may expand to, and may take on the wire
        # (zstd's worst case is a little over raw): more is a lie, refused unread.
        self.cap = layer_cap(self.heads, self.n, self.head_dim)
        wire_cap = self.cap + self.cap // 128 + (64 << 10)
        self.max_frame = max(wire_cap, 4 * (vocab_size or 0), CONTROL_MAX_FRAME)

    def take(self, reader: FrameReader, header: Header) -> None:
        """One KV_LAYER frame: read (in place where it fits), checked, placed."""
        m = self.m
        if self.slots is not None:
            self.into = self.into or self.slots()
            kv, t_payload, raw_bytes = receive_layer(reader, header, self.into, self.cap)
        else:
            payload = reader.buffer(header.length)
            reader.read_into(payload)
            reader.finish()
            t_payload = time.perf_counter()
            kv = decode_layer(payload, max_bytes=self.cap)
            raw_bytes = block_bytes(kv)
        # In place, receiving raw bytes is decoding them: counted as link time.
        m["kv_decode_time"] += time.perf_counter() - t_payload
        if header.length >= MIN_LINK_FRAME:
            # From the header's arrival: time on the wire, not waiting for compute.
            m["kv_link_bytes"] += header.length
            m["kv_link_time"] += t_payload - reader.header_at
        if kv.quant is not None and kv.quant != self.request.kv_quant:
            raise ProtocolError(f"{kv.quant} K/V for a request that asked for lossless")
        m["kv_quant"] = kv.quant
        # The codec's own bytes, so the codec tuner's ratio is not the quantizer's.
        m["kv_raw_bytes"] += raw_bytes
        m["kv_payload_bytes"] += header.length - LAYER_HEADER.size
        self.put(kv)
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
            m["kv_first_layer_at"] = time.time()
        self.got.add(kv.layer)
        m["kv_bytes"] += HEADER.size + header.length

    def put(self, kv: LayerKV) -> None:
        """A decoded layer into its cache, once, if its shape fits this prompt."""
        if not 0 <= kv.layer < len(self.caches) or kv.layer in self.got:
            raise ProtocolError(f"unexpected KV for layer {kv.layer}")
        if kv.keys.shape[0] != self.heads or kv.keys.shape[2] != self.head_dim:
            raise ProtocolError(f"layer {kv.layer} K/V has shape {kv.keys.shape}")
        prefix = self.prefix
        if prefix and kv.kind == Kind.FULL and kv.keys.shape[1] == self.n - prefix.start:
            kv = prefix.extend(kv)
        try:
            check_layer(self.caches[kv.layer], kv, self.n)
            self.place(self.caches[kv.layer], kv, self.n)
        except ValueError as e:  # token count or cache kind does not fit
            raise ProtocolError(str(e)) from None

    def logits(self, payload: memoryview) -> np.ndarray:
        if len(payload) % 4:
            raise ProtocolError(f"LOGITS of {len(payload)} bytes: not float32s")
        logits = np.frombuffer(bytes(payload), np.float32)
        if self.vocab_size and logits.shape[0] != self.vocab_size:
            raise ProtocolError(f"{logits.shape[0]} logits for a vocab of {self.vocab_size}")
        return logits


def fetch_kv(
    target: PrefillTarget,
    request: PrefillRequest,
    into: Into,
    hello: dict[str, Any],
    token: bytes | None = None,
    vocab_size: int | None = None,
) -> tuple[dict[str, Any], np.ndarray]:
    """Fill `into.caches` with the K/V of `request.token_ids` from the prefill agent;
    return metrics and the float32 logits of the prompt's last position.
    `into.gone()` true (our client left): HungUp, and the connection closes, so the
    prefill agent drops the prompt instead of computing it for nobody.

    With `request.kv_quant` "int8" the K/V travels lossy as int8 rows and is
    dequantized here (a lossless stream is taken too: an older prefill agent).
    With `into.prefix`, the decode side holds the first `prefix.start` positions and
    asked only for the rest; a full-attention layer that arrives as just those
    is extended with them (an older prefill agent sends all: taken as is).
    With `into.slots`, layers that fit are received in place (disagg_agents.decode.kvslots).

    Raises PrefillUnavailable when the agent is down, slow past its timeout, fails,
    or drops the stream (the caller prefills locally); RemoteError only for a
    model mismatch, which must never be papered over by a local prefill.
    """
    t0 = time.perf_counter()
    addr = f"{target.hosts[0]}:{target.port}"
    try:
        session = open_session(target, hello, token)
        addr = session.addr
        try:
            got = receive_layers(
                session.sock,
                request,
                into,
                hello["fingerprint"],
                vocab_size,
                packed_ids_offered(session.hello_ok),
            )
        finally:
            session.sock.close()
    except (OSError, ProtocolError, MemoryError) as e:
        why = printable(e)
        kind = "timeout" if isinstance(e, TimeoutError) else "stream"
        raise PrefillUnavailable(f"prefill stream from {addr} failed: {why}", kind) from e
    except PeerAuthError as e:
        # Not a fault to paper over with a local prefill: the cluster is misconfigured.
        raise RemoteError("unauthorized", f"cannot use prefill agent {addr}: {e}") from e
    except RemoteError as e:
        if e.code == "model_mismatch":
            raise  # the user must see this; prefilling locally would hide it
        why = f"{printable(e.code, 40)}: {printable(e.message)}"
        raise PrefillUnavailable(f"prefill agent {addr} failed: {why}", "prefill_error") from e
    return fetch_metrics(request, session, got, t0), got.logits


def _small_int(v: Any) -> int | None:
    """A count from the peer's PREFILL_DONE, passed on to clients only if sane."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536 else None


def _count(v: Any) -> int | None:
    """A count from the peer's PREFILL_DONE (0 included), or None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31 else None


def fetch_metrics(
    request: PrefillRequest, session: PrefillLink, got: Received, t0: float
) -> dict[str, Any]:
    """The metrics of one fetch, in the names results carry."""
    done, ok = got.done, session.hello_ok
    m = {
        **got.metrics,
        "codec": request.codec,
        "prefill_time": done.get("prefill_time"),
        "prefill_server": ok.get("server") or session.addr,
        "weights": ok.get("weights", "same"),
        "prefill_address": session.addr,
        "kv_transfer_time": (got.last - got.first) if got.first and got.last else 0.0,
        "kv_wait_time": (got.first - got.t_sent) if got.first else None,
        "kv_fetch_time": time.perf_counter() - t0,
        "prefill_last_layer_at": done.get("last_layer_at"),
        "kv_encode_time": done.get("kv_encode_time"),
        "kv_quant_time": done.get("kv_quant_time"),
        "prefill_cached_tokens": int(done.get("cached_tokens") or 0),
        "prefill_queue_time": done.get("queue_time"),
        # For placement only (kvsource takes it out before metrics reach clients).
        "prefill_queue_waiting": _count(done.get("queue_waiting")),
        "prefill_threads": _small_int(done.get("threads")),
        # perf_counter times on this host for the caller's timeline (disagg_agents.decode
        # turns them into offsets); never sent on.
        "marks": {"sent": got.t_sent, "kv_first": got.first, "kv_last": got.last},
    }
    if isinstance(done.get("codec_probe"), dict):
        m["codec_probe"] = done["codec_probe"]
    if session.failures:
        m["path_failures"] = session.failures
    return m

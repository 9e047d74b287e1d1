"""Wire protocol between disagg clients, decode agents and prefill agents.

Bytes only: nothing here imports torch or mlx. Every frame is a fixed 16-byte
header followed by a payload:

    magic "DG" | version u8 | type u8 | flags u8 | 3 pad | payload length u64

Control payloads (hello, requests, metrics, errors) are small JSON objects.
KV payloads are binary (see `kvcodec`); tensors never travel as JSON or base64.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAGIC = b"DG"
VERSION = 1
HEADER = struct.Struct("<2sBBB3xQ")
# Refuse absurd lengths before allocating: one layer of a 30B model at 32k
# tokens is ~0.5 GiB, so 2 GiB leaves room without letting a peer OOM us.
DEFAULT_MAX_FRAME = 2 << 30
# Control frames (requests, hellos, token ids) from peers; agents pass their
# --max-request-bytes to recv_json instead.
CONTROL_MAX_FRAME = 16 << 20
# Before a peer has proved the token: CHALLENGE, AUTH, AUTH_OK and a short ERROR
# are all far below this, so an unknown peer never makes us hold more.
PREAUTH_MAX_FRAME = 4096
# Frames are received into memory that grows as bytes arrive, in steps of at
# most this: a header that claims 16 MiB costs nothing until 16 MiB came.
RECV_STEP = 256 << 10
# Peer text (ERROR messages, bad JSON) in logs and messages is cut to this.
PEER_TEXT_MAX = 200
# A PREFILL flag: the JSON (without token_ids) is length-prefixed and the token
# ids follow it as little-endian uint32s, 4 bytes each instead of JSON text that
# both sides spent ~0.2 ms each on for 2,000 ids. Sent only to a prefill agent
# whose HELLO_OK says IDS_U32_CAP.
IDS_U32 = 1
IDS_U32_CAP = {"ids": "u32"}
_JSON_LEN = struct.Struct("<I")


def packed_ids_offered(hello_ok: dict[str, Any]) -> bool:
    return all(hello_ok.get(k) == v for k, v in IDS_U32_CAP.items())


class Frame(enum.IntEnum):
    HELLO = 1  # {"version", "role", "fingerprint", "model"}
    HELLO_OK = 2  # {"role", "fingerprint", "model", "server"}
    PREFILL = 3  # {"request_id", "token_ids", "codec", "kv_quant"}
    KV_LAYER = 4  # binary, see kvcodec
    PREFILL_DONE = 5  # {"prefill_time", "tokens", "last_layer_at", ...}
    GENERATE = 6  # client -> decode agent: the request
    TOKEN = 7  # {"id", "text"}
    DONE = 8  # {"text", "token_ids", "metrics"}
    ERROR = 9  # {"code", "message"}
    LOGPROBS = 10  # binary float32 vector, only when a request asks for it
    CHALLENGE = 11  # server -> client, first frame of every connection: {"nonce", "auth"}
    AUTH = 12  # client -> server: {"nonce", "mac"}
    AUTH_OK = 13  # server -> client: {"mac"}, the server's proof
    LOGITS = 14  # prefill -> decode: float32 logits of the prompt's last position
    # decode -> client, only when the GENERATE asked for it (PROGRESS_KEY): "still
    # working" while no token is due, {"phase": "queued"|"prefill"|"decode", ...}.
    PROGRESS = 15


# The GENERATE frame's key asking for PROGRESS frames at least this often (seconds);
# a transport matter, not a request field: the decode agent pops it before parsing.
PROGRESS_KEY = "progress_s"


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame, or hung up."""


class PeerClosed(ProtocolError):
    """The peer hung up cleanly between two frames (before a header's first byte)."""


class DeadlineExceeded(ProtocolError):
    """The peer did not finish in time (the handshake deadline, for instance)."""


class AuthError(Exception):
    """A peer failed to prove it holds the cluster token (or we have none to prove)."""


class RemoteError(Exception):
    """The peer answered with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object, limit: int | None = PEER_TEXT_MAX) -> str:
    """Peer-supplied text made safe for one log line: control characters shown
    as escapes (\\x1b, \\n), never interpreted; at most `limit` characters."""
    raw = str(text)
    head = raw if limit is None else raw[:limit]
    out = "".join(
        _ESCAPES.get(c)
        or (c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        for c in head
    )
    if limit is not None and (len(out) > limit or len(raw) > limit):
        return out[:limit] + "..."
    return out


class Deadline:
    """One point in time for a whole exchange (e.g. the handshake), however its
    bytes trickle in: each recv may wait only for what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"did not finish within {self.seconds:g}s")
        return left


@dataclass(frozen=True)
class Header:
    type: Frame
    flags: int
    length: int


def pack_header(ftype: Frame, length: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(ftype), flags, length)


def parse_header(raw: bytes | bytearray | memoryview, max_frame: int) -> Header:
    """Validate a 16-byte header; never trusts the peer's length blindly."""
    if len(raw) != HEADER.size:
        raise ProtocolError(f"short header: {len(raw)} bytes")
    magic, version, ftype, flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a disagg peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
    try:
        kind = Frame(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the cap of {max_frame}")
    return Header(kind, flags, length)


# A sendmsg carries at most one buffer this large, with the small ones before
# it: a KV_LAYER's header and K go in one call, its V in the next. One call per
# whole 1.5 MB bf16 frame measured 0.8-1.4 ms slower per 46 MB loopback handoff
# than this, in five interleaved runs on a 2-core VM (why, in the kernel, I did
# not find); splitting by size instead (384 or 768 KB calls) did not help.
SPLIT_BYTES = 64 << 10


Call = tuple[list[memoryview], int]  # one sendmsg's views, and their bytes


def _calls(views: Sequence[memoryview]) -> list[Call]:
    """`views` grouped into sendmsg calls: each up to and including the next
    large one, at most 512 views (IOV_MAX is 1024 on Linux and macOS)."""
    calls: list[Call] = []
    group: list[memoryview] = []
    for v in views:
        if not len(v):
            continue
        group.append(v)
        if len(v) >= SPLIT_BYTES or len(group) == 512:
            calls.append((group, sum(map(len, group))))
            group = []
    if group:
        calls.append((group, sum(map(len, group))))
    return calls


def send_calls(
    sock: socket.socket, calls: Sequence[Call], progress: Callable[[], None] | None = None
) -> int:
    """Send grouped views, one sendmsg per group when the peer takes it whole;
    `progress` is called each time the peer took some bytes."""
    total = 0
    for views, size in calls:
        sent = sock.sendmsg(views)
        if progress is not None:
            progress()
        if sent < size:
            _send_rest(sock, views, sent, progress)
        total += size
    return total


def _send_rest(
    sock: socket.socket, views: list[memoryview], sent: int, progress: Callable[[], None] | None
) -> None:
    """The rest of a group the peer took part of (a full socket buffer)."""
    views = list(views)
    while views:
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        if views:
            sent = sock.sendmsg(views)
            if progress is not None:
                progress()


def send_buffers(
    sock: socket.socket,
    buffers: Sequence[bytes | bytearray | memoryview],
    progress: Callable[[], None] | None = None,
) -> int:
    """Send buffers back to back with sendmsg, without joining them first."""
    return send_calls(sock, _calls([memoryview(b).cast("B") for b in buffers]), progress)


@dataclass(frozen=True, slots=True)
class OutFrame:
    """A frame made ready to send: header, payload as flat byte views, and those
    grouped into sendmsg calls. Made by `out_frame` on the thread that has the
    data, the sending thread runs almost no Python between two large sendmsg
    calls: run there, cold after each 0.8 MB copy, the ~25 us of Python that
    building a KV_LAYER frame takes cost as much wire time (bf16 loopback: the
    wire stood idle ~0.8 ms of a 46 MB, 30-layer handoff)."""

    head: bytes
    parts: list[memoryview]
    calls: list[Call]  # head and parts, grouped


def out_frame(
    ftype: Frame, payload: Sequence[bytes | bytearray | memoryview] | bytes = b"", flags: int = 0
) -> OutFrame:
    buffers = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    parts = [memoryview(p).cast("B") for p in buffers]
    head = pack_header(ftype, sum(map(len, parts)), flags)
    return OutFrame(head, parts, _calls([memoryview(head), *parts]))


def send_out(
    sock: socket.socket, frame: OutFrame, progress: Callable[[], None] | None = None
) -> int:
    """Send a frame made by `out_frame` (sealed and serialized as the socket asks)."""
    seal = _SEALS.get(sock)
    if seal is None:
        lock = _SEND_LOCKS.get(sock)
        if lock is None:
            return send_calls(sock, frame.calls, progress)
        with lock:
            return send_calls(sock, frame.calls, progress)
    with seal.send_lock:  # the tag's sequence number is the frame's place on the wire
        tag = seal.sign(frame.head, frame.parts)
        return send_buffers(sock, [frame.head, *frame.parts, tag], progress)


def send_frame(
    sock: socket.socket,
    ftype: Frame,
    payload: Sequence[bytes | bytearray | memoryview] | bytes = b"",
    flags: int = 0,
    progress: Callable[[], None] | None = None,
) -> int:
    return send_out(sock, out_frame(ftype, payload, flags), progress)


# Sockets that several threads send frames on (a decode agent's tokens and its
# PROGRESS frames): each frame goes out whole. A sealed socket's lock does that already.
_SEND_LOCKS: weakref.WeakKeyDictionary[socket.socket, threading.Lock] = weakref.WeakKeyDictionary()


def serialize_sends(sock: socket.socket) -> None:
    """From now on, frames sent on `sock` from several threads never interleave.
    Call it before a second thread starts sending."""
    if sock not in _SEND_LOCKS:
        _SEND_LOCKS[sock] = threading.Lock()


def json_bytes(obj: dict[str, Any]) -> bytes:
    """A control frame's JSON, compact."""
    return json.dumps(obj, separators=(",", ":")).encode()


def send_json(sock: socket.socket, ftype: Frame, obj: dict[str, Any]) -> int:
    return send_frame(sock, ftype, json_bytes(obj))


def send_error(sock: socket.socket, code: str, message: str) -> None:
    """Best effort: the peer may already be gone."""
    with contextlib.suppress(OSError):
        send_json(sock, Frame.ERROR, {"code": code, "message": message})


def _recv_into(
    sock: socket.socket, view: memoryview, deadline: Deadline | None, got: int = 0, total: int = 0
) -> int:
    """Fill `view` from the socket: the one receive loop. `got` and `total` place
    `view` within the whole part being received, for the error message."""
    n, at = len(view), 0
    total = max(total, got + n)
    while at < n:
        if deadline is not None:
            sock.settimeout(deadline.left())
        try:
            r = sock.recv_into(view[at:], n - at)
        except TimeoutError:
            if deadline is not None:
                deadline.left()  # raises DeadlineExceeded when that is why
            raise
        if r == 0:
            raise ProtocolError(f"connection closed after {got + at} of {total} bytes")
        at += r
    return at


def recv_exact(sock: socket.socket, n: int, deadline: Deadline | None = None) -> bytearray:
    """`n` bytes, held in memory that grows as they arrive (never `n` up front)."""
    buf = bytearray(min(n, RECV_STEP))
    got = 0
    while True:
        with memoryview(buf) as view:
            got += _recv_into(sock, view[got:], deadline, got, n) if got < len(buf) else 0
        if got == n:
            return buf
        # Double, bounded by what was claimed: at most twice what actually came.
        buf.extend(bytes(min(n, 2 * len(buf)) - len(buf)))


def _recv_header(sock: socket.socket, into: bytearray, deadline: Deadline | None) -> None:
    with memoryview(into) as view:
        if deadline is not None:
            sock.settimeout(deadline.left())
        try:
            first = sock.recv_into(view, HEADER.size)
        except TimeoutError:
            if deadline is not None:
                deadline.left()
            raise
        if first == 0:
            raise PeerClosed("connection closed")
        if first < HEADER.size:
            _recv_into(sock, view[first:], deadline, first, HEADER.size)


def recv_frame(
    sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME, deadline: Deadline | None = None
) -> tuple[Header, bytearray]:
    """One frame. PeerClosed when the peer hung up before it began; the payload's
    memory grows with what arrives, so a lying length costs nothing."""
    head = bytearray(HEADER.size)
    _recv_header(sock, head, deadline)
    header = parse_header(head, max_frame)
    payload = recv_exact(sock, header.length, deadline)
    seal = _SEALS.get(sock)
    if seal is not None:
        seal.verify(header, head, payload, recv_exact(sock, TAG_BYTES, deadline))
    return header, payload


class FrameReader:
    """Reads one socket's frames into one reusable buffer: once it has grown to
    the largest frame, receiving allocates nothing (the KV stream's layers are
    all one size). A payload is a view of that buffer, valid until the next
    `read`; `header_at` is when the last header had arrived (perf_counter).
    For authenticated peers only: a frame's buffer is sized from its header.

    `read` takes a whole frame; `next`, `read_into` (any views, in order, until
    the payload is taken) and `finish` take one in pieces, so a payload can land
    where it is finally kept (agents.kvinplace). A sealed frame's tag is checked
    in `finish`, before anyone uses what it carried."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.header_at = 0.0
        self._head = bytearray(HEADER.size)
        self._buf = bytearray(0)
        self._header: Header | None = None
        self._left = 0  # payload bytes of the current frame not yet read
        self._mac: Any = None  # the current sealed frame's running HMAC

    def read(self) -> tuple[Header, memoryview]:
        header = self.next()
        view = self.buffer(header.length)
        self.read_into(view)
        self.finish()
        return header, view

    def next(self) -> Header:
        """The next frame's header; its payload is read with read_into."""
        _recv_header(self.sock, self._head, None)
        self.header_at = time.perf_counter()
        header = parse_header(self._head, self.max_frame)
        seal = _SEALS.get(self.sock)
        self._mac = seal.start(self._head) if seal is not None else None
        self._header, self._left = header, header.length
        return header

    def buffer(self, n: int) -> memoryview:
        """`n` bytes of the reusable buffer (grown to fit), valid until the next call."""
        if n > len(self._buf):
            self._buf = bytearray(n)  # the old one lives on in old views only
        return memoryview(self._buf)[:n]

    def read_into(self, view: memoryview) -> None:
        """The current payload's next len(view) bytes, into `view`."""
        if len(view) > self._left:
            raise ProtocolError(f"read of {len(view)} bytes past the frame's end")
        _recv_into(self.sock, view, None)
        self._left -= len(view)
        if self._mac is not None:
            self._mac.update(view)

    def read_into_many(self, views: list[memoryview]) -> None:
        """read_into for several views in order, each recv filling as many as the
        socket has bytes for (recvmsg_into: fewer wakeups than one view at a time)."""
        total = sum(v.nbytes for v in views)
        if total > self._left:
            raise ProtocolError(f"read of {total} bytes past the frame's end")
        pending = [v for v in views if v.nbytes]
        got = at = 0  # bytes read; pending[at] is the first view not yet full
        while at < len(pending):
            n = self.sock.recvmsg_into(pending[at : at + 512])[0]  # IOV_MAX is 1024
            if n == 0:
                raise ProtocolError(f"connection closed after {got} of {total} bytes")
            got += n
            while n:
                size = pending[at].nbytes
                if n >= size:
                    n -= size
                    at += 1
                else:
                    pending[at], n = pending[at][n:], 0
        self._left -= total
        if self._mac is not None:
            for v in views:
                self._mac.update(v)

    def finish(self) -> None:
        """End the current frame: its payload must be all read; check its tag."""
        if self._left or self._header is None:
            raise ProtocolError(f"frame ended with {self._left} payload bytes unread")
        seal = _SEALS.get(self.sock)
        if seal is not None and self._mac is not None:
            seal.check(self._header, self._mac, recv_exact(self.sock, TAG_BYTES, None))
        self._header, self._mac = None, None


def decode_json(header: Header, payload: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload) if isinstance(payload, memoryview) else payload)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, 4300+ digit ints
        raise ProtocolError(f"{header.type.name} frame is not valid JSON: {printable(e)}") from None
    except RecursionError:
        raise ProtocolError(f"{header.type.name} frame nests JSON too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{header.type.name} frame must hold a JSON object")
    return obj


def error_from(header: Header, payload: bytes | bytearray | memoryview) -> RemoteError:
    """An ERROR frame as the exception to raise: code and message as strings."""
    obj = decode_json(header, payload)
    return RemoteError(str(obj.get("code", "error")), str(obj.get("message", "")))


def recv_control(
    sock: socket.socket,
    expect: Frame | tuple[Frame, ...],
    max_frame: int = CONTROL_MAX_FRAME,
    deadline: Deadline | None = None,
) -> tuple[Header, bytearray]:
    """Receive one control frame, undecoded; an ERROR frame becomes RemoteError,
    a hang-up between frames PeerClosed."""
    header, payload = recv_frame(sock, max_frame, deadline)
    allowed = expect if isinstance(expect, tuple) else (expect,)
    if header.type == Frame.ERROR:
        raise error_from(header, payload)
    if header.type not in allowed:
        names = "/".join(f.name for f in allowed)
        raise ProtocolError(f"expected {names}, got {header.type.name}")
    return header, payload


def recv_json(
    sock: socket.socket,
    expect: Frame | tuple[Frame, ...],
    max_frame: int = CONTROL_MAX_FRAME,
    deadline: Deadline | None = None,
) -> tuple[Frame, dict[str, Any]]:
    """recv_control, its JSON object decoded."""
    header, payload = recv_control(sock, expect, max_frame, deadline)
    return header.type, decode_json(header, payload)


def send_json_ids(sock: socket.socket, ftype: Frame, obj: dict[str, Any], ids: bytes) -> int:
    """A JSON object and packed token ids in one frame (IDS_U32)."""
    text = json_bytes(obj)
    return send_frame(sock, ftype, [_JSON_LEN.pack(len(text)), text, ids], IDS_U32)


def split_json_ids(header: Header, payload: bytearray) -> tuple[dict[str, Any], memoryview | None]:
    """A control frame's JSON object, and with IDS_U32 the packed ids after it
    (None without). Unknown flags are refused: they would change the meaning."""
    if header.flags & ~IDS_U32:
        raise ProtocolError(f"{header.type.name} frame with unknown flags {header.flags:#x}")
    if not header.flags & IDS_U32:
        return decode_json(header, payload), None
    view = memoryview(payload)
    if len(view) < _JSON_LEN.size:
        raise ProtocolError(f"{header.type.name} frame too short for its JSON's length")
    end = _JSON_LEN.size + _JSON_LEN.unpack_from(view)[0]
    if end > len(view) or (len(view) - end) % 4:
        raise ProtocolError(f"{header.type.name} frame's ids are not whole uint32s")
    return decode_json(header, view[_JSON_LEN.size : end]), view[end:]


# -- model fingerprint ------------------------------------------------------

FINGERPRINT_KEYS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "dtype", "layers")


def fingerprint_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Name every fingerprint field on which two agents disagree."""
    diffs = []
    for key in FINGERPRINT_KEYS:
        a, b = ours.get(key), theirs.get(key)
        if key == "layers" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            bad = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            if bad:
                diffs.append(f"layers {bad[:4]} cache kind/window {a[bad[0]]} vs {b[bad[0]]}")
            continue
        if a != b:
            diffs.append(f"{key} {a} vs {b}")
    return diffs


# -- authentication ---------------------------------------------------------
# Challenge-response with HMAC-SHA256 over both sides' nonces: the token never
# crosses the wire, a recorded exchange cannot be replayed (fresh nonces), and
# the server proves it knows the token too.

NONCE_BYTES = 32
TOKEN_MIN_CHARS = 32  # a cluster token file holds at least this (the generator writes 64 hex)
# What protects the frames after the handshake, chosen by the client:
# "mac": every frame carries an HMAC-SHA256 tag over its sequence number, header
# and payload, keyed per connection and direction from the token and both nonces;
# a frame altered, injected, dropped or replayed is refused. "none": nothing (an
# older peer, or a pipeline on a link its operator trusts). Neither hides content.
INTEGRITY = ("mac", "none")


def _mac(token: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes, mode: str) -> bytes:
    # The mode is inside the proof (but "none" keeps the old message): stripping
    # "mac" from an AUTH on the path makes the proof fail, not the frames bare.
    tag = b"" if mode == "none" else b"|" + mode.encode()
    msg = b"disagg-auth-v1|" + side + tag + b"|" + server_nonce + b"|" + client_nonce
    return hmac.new(token, msg, hashlib.sha256).digest()


def _hex_field(obj: dict[str, Any], key: str, size: int) -> bytes:
    try:
        raw = bytes.fromhex(str(obj.get(key, "")))
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ProtocolError(f"{key} must be {size} bytes of hex")
    return raw


# -- integrity after the handshake --------------------------------------------

TAG_BYTES = 32  # HMAC-SHA256, after each frame's payload (not counted in its length)


class IntegrityError(ProtocolError):
    """A frame's tag does not match: altered, injected, reordered or replayed."""


class Seal:
    """One connection's frame keys and sequence numbers, both directions."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self.send_key, self.recv_key = send_key, recv_key
        self.sent = self.received = 0
        self.send_lock = threading.Lock()

    @staticmethod
    def _tag(key: bytes, seq: int, head: bytes | bytearray, parts: Sequence[Any]) -> bytes:
        h = hmac.new(key, seq.to_bytes(8, "little"), hashlib.sha256)
        h.update(head)
        for p in parts:
            h.update(p)
        return h.digest()

    def sign(self, head: bytes, parts: Sequence[Any]) -> bytes:
        tag = self._tag(self.send_key, self.sent, head, parts)
        self.sent += 1
        return tag

    def verify(
        self, header: Header, head: bytes | bytearray, payload: Any, tag: bytes | bytearray
    ) -> None:
        mac = self.start(head)
        mac.update(payload)
        self.check(header, mac, tag)

    def start(self, head: bytes | bytearray) -> Any:
        """The running HMAC of the next received frame, over its header so far
        (the payload is added as it arrives; `check` ends it)."""
        h = hmac.new(self.recv_key, self.received.to_bytes(8, "little"), hashlib.sha256)
        h.update(head)
        return h

    def check(self, header: Header, mac: Any, tag: bytes | bytearray) -> None:
        if not hmac.compare_digest(bytes(tag), mac.digest()):
            raise IntegrityError(
                f"{header.type.name} frame {self.received} failed its integrity check "
                "(altered on the path?): connection dropped"
            )
        self.received += 1


# Sockets whose frames are sealed; a socket leaves with its last reference.
_SEALS: weakref.WeakKeyDictionary[socket.socket, Seal] = weakref.WeakKeyDictionary()


def _seal(sock: socket.socket, token: bytes, sn: bytes, cn: bytes, server: bool) -> None:
    c2s, s2c = (
        hmac.new(token, b"disagg-frames-v1|" + d + b"|" + sn + cn, hashlib.sha256).digest()
        for d in (b"c2s", b"s2c")
    )
    _SEALS[sock] = Seal(s2c, c2s) if server else Seal(c2s, s2c)


def sealed(sock: socket.socket) -> bool:
    """Whether this connection's frames carry tags (see INTEGRITY)."""
    return sock in _SEALS


def server_auth(
    sock: socket.socket,
    token: bytes | None,
    deadline: Deadline | None = None,
    max_frame: int = PREAUTH_MAX_FRAME,
) -> None:
    """Open a connection as the server; raises AuthError after telling the peer why.

    The whole exchange must end by `deadline`, and no frame may exceed `max_frame`
    (the answer is tiny): an unknown peer costs a few kB for a bounded time.
    Frames after it are sealed when the client asks (see INTEGRITY)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    challenge: dict[str, Any] = {"nonce": nonce.hex(), "auth": token is not None}
    if token is not None:
        challenge["integrity"] = ["mac"]
    send_json(sock, Frame.CHALLENGE, challenge)
    if token is None:
        return
    try:
        _, msg = recv_json(sock, Frame.AUTH, max_frame, deadline)
        client_nonce = _hex_field(msg, "nonce", NONCE_BYTES)
        mac = _hex_field(msg, "mac", hashlib.sha256().digest_size)
        mode = msg.get("integrity", "none")
        if mode not in INTEGRITY:
            raise ProtocolError(f"integrity {printable(mode, 20)}: this agent knows mac, none")
    except RemoteError as e:
        reason = f"sent ERROR {printable(e.code, 40)}: {printable(e.message)}"
        send_error(sock, "unauthorized", "authentication required")
        raise AuthError(reason) from None
    except ProtocolError as e:
        if isinstance(e, PeerClosed | DeadlineExceeded):
            raise
        send_error(sock, "unauthorized", f"authentication required: {e}")
        raise AuthError(str(e)) from None
    if not hmac.compare_digest(mac, _mac(token, b"client", nonce, client_nonce, mode)):
        send_error(sock, "unauthorized", "wrong token: this agent belongs to another cluster")
        raise AuthError("wrong token")
    proof = _mac(token, b"server", nonce, client_nonce, mode)
    send_json(sock, Frame.AUTH_OK, {"mac": proof.hex()})
    if mode == "mac":
        _seal(sock, token, nonce, client_nonce, server=True)


def client_auth(sock: socket.socket, token: bytes | None, integrity: str = "mac") -> None:
    """Open a connection as the client: answer the server's challenge.

    Holding a token, we require the server's proof: one whose challenge says it
    wants no token (a process that grabbed the port, say) is refused. With
    `integrity` "mac" every later frame is sealed; a server that cannot is refused."""
    _, challenge = recv_json(sock, Frame.CHALLENGE, PREAUTH_MAX_FRAME)
    nonce = _hex_field(challenge, "nonce", NONCE_BYTES)
    if not challenge.get("auth"):
        if token is None:
            return
        raise AuthError(
            "the agent runs without a cluster token, so it cannot prove it belongs to this "
            "cluster: refusing to send it work; restart it with --token-file"
        )
    if token is None:
        raise AuthError("the agent requires the cluster token and none was given")
    offered = challenge.get("integrity")
    if integrity == "mac" and not (isinstance(offered, list) and "mac" in offered):
        raise AuthError(
            "the agent cannot check frames after the handshake (an older release?): "
            'upgrade it, or set integrity = "none" for this pipeline'
        )
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(token, b"client", nonce, client_nonce, integrity)
    auth: dict[str, Any] = {"nonce": client_nonce.hex(), "mac": mac.hex()}
    if integrity != "none":
        auth["integrity"] = integrity
    send_json(sock, Frame.AUTH, auth)
    try:
        _, ok = recv_json(sock, Frame.AUTH_OK, PREAUTH_MAX_FRAME)
    except RemoteError as e:
        raise AuthError(printable(e.message)) from None
    proof = _hex_field(ok, "mac", hashlib.sha256().digest_size)
    if not hmac.compare_digest(proof, _mac(token, b"server", nonce, client_nonce, integrity)):
        raise AuthError("the agent could not prove it holds the cluster token")
    if integrity == "mac":
        _seal(sock, token, nonce, client_nonce, server=False)

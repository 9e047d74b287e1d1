"""Frames on a socket: scatter-gather sends, bounded receives, the one reusable
buffer of a K/V stream, and JSON control frames. Sealed connections (`seal`) get
their tags written and checked here."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_agents.wire.frames import (
    CONTROL_MAX_FRAME,
    DEFAULT_MAX_FRAME,
    HEADER,
    IDS_U32,
    JSON_LEN,
    RECV_STEP,
    Deadline,
    Frame,
    Header,
    PeerClosed,
    ProtocolError,
    decode_json,
    error_from,
    json_bytes,
    pack_header,
    parse_header,
)
from disagg_agents.wire.seal import TAG_BYTES, seal_of

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
    seal = seal_of(sock)
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
    seal = seal_of(sock)
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
    where it is finally kept (disagg_agents.decode.kvslots). A sealed frame's tag is checked
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
        seal = seal_of(self.sock)
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
        seal = seal_of(self.sock)
        if seal is not None and self._mac is not None:
            seal.check(self._header, self._mac, recv_exact(self.sock, TAG_BYTES, None))
        self._header, self._mac = None, None


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
    return send_frame(sock, ftype, [JSON_LEN.pack(len(text)), text, ids], IDS_U32)

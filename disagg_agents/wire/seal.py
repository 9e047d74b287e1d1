"""Integrity after the handshake: each frame of a sealed connection carries an
HMAC-SHA256 tag over its sequence number, header and payload, keyed per connection
and direction from the cluster token and both sides' nonces."""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from disagg_agents.wire.frames import Header, ProtocolError

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


def seal_connection(sock: socket.socket, token: bytes, sn: bytes, cn: bytes, server: bool) -> None:
    c2s, s2c = (
        hmac.new(token, b"disagg-frames-v1|" + d + b"|" + sn + cn, hashlib.sha256).digest()
        for d in (b"c2s", b"s2c")
    )
    _SEALS[sock] = Seal(s2c, c2s) if server else Seal(c2s, s2c)


def sealed(sock: socket.socket) -> bool:
    """Whether this connection's frames carry tags (see INTEGRITY)."""
    return sock in _SEALS


def seal_of(sock: socket.socket) -> Seal | None:
    """The connection's seal, or None when its frames carry no tags."""
    return _SEALS.get(sock)

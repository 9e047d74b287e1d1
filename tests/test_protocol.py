"""Frames on socketpairs: no models, no network."""

from __future__ import annotations

import struct
import threading

import pytest

from disagg_agents.wire.channel import (
    SPLIT_BYTES,
    recv_frame,
    recv_json,
    send_buffers,
    send_error,
    send_frame,
    send_json,
)
from disagg_agents.wire.fingerprint import fingerprint_mismatch
from disagg_agents.wire.frames import (
    DEFAULT_MAX_FRAME,
    HEADER,
    MAGIC,
    VERSION,
    Frame,
    ProtocolError,
    RemoteError,
    pack_header,
    parse_header,
)
from tests.conftest import socket_pair


def test_json_frame_round_trip() -> None:
    a, b = socket_pair()
    send_json(a, Frame.GENERATE, {"prompt": "hi", "max_tokens": 3})
    kind, obj = recv_json(b, Frame.GENERATE)
    assert kind == Frame.GENERATE and obj == {"prompt": "hi", "max_tokens": 3}


def test_multi_buffer_frame_arrives_whole() -> None:
    a, b = socket_pair()
    parts = [b"x" * 70_000, memoryview(b"y" * 100_000), bytearray(b"z" * 5)]
    sender = threading.Thread(target=send_frame, args=(a, Frame.KV_LAYER, parts))
    sender.start()
    header, payload = recv_frame(b)
    sender.join()
    assert header.type == Frame.KV_LAYER
    assert bytes(payload) == b"x" * 70_000 + b"y" * 100_000 + b"z" * 5


class _ShortSends:
    """A socket whose sendmsg takes at most `cap` bytes a call, recording each
    call's buffers (their lengths) and keeping the bytes in order."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls: list[list[int]] = []
        self.data = bytearray()

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self.calls.append([len(b) for b in buffers])
        room = self.cap
        for b in buffers:
            took = bytes(b[:room])
            self.data += took
            room -= len(took)
            if not room:
                break
        return self.cap - room


@pytest.mark.parametrize("cap", [1 << 30, 50_000])
def test_send_buffers_gives_each_large_buffer_its_own_call(cap: int) -> None:
    # A KV_LAYER's header and K in one sendmsg, V in the next (SPLIT_BYTES);
    # small buffers still go together, and short sends resume where they stopped.
    big = SPLIT_BYTES
    parts = [b"h" * 16, b"l" * 40, b"k" * big * 2, b"v" * big * 2, b"t" * 32, b"u" * 8]
    sock = _ShortSends(cap)
    sent = send_buffers(sock, parts, None)  # type: ignore[arg-type]
    assert sent == sum(map(len, parts)) and bytes(sock.data) == b"".join(parts)
    for call in sock.calls:
        large = [n for n in call if n >= big]
        assert len(large) <= 1 and (not large or call[-1] == large[0]), sock.calls
    if cap > sent:  # whole sends: exactly these three calls
        assert sock.calls == [[16, 40, 2 * big], [2 * big], [32, 8]]


def test_error_frame_becomes_remote_error() -> None:
    a, b = socket_pair()
    send_error(a, "model_mismatch", "prefill has A, decode has B")
    with pytest.raises(RemoteError) as info:
        recv_json(b, Frame.HELLO_OK)
    assert info.value.code == "model_mismatch" and "A" in info.value.message


@pytest.mark.parametrize(
    "raw, message",
    [
        (HEADER.pack(b"XX", VERSION, 1, 0, 0), "bad magic"),
        (HEADER.pack(MAGIC, 99, 1, 0, 0), "protocol version 99"),
        (HEADER.pack(MAGIC, VERSION, 200, 0, 0), "unknown frame type"),
        (HEADER.pack(MAGIC, VERSION, 1, 0, 1 << 40), "exceeds the cap"),
    ],
)
def test_bad_headers_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_header(raw, DEFAULT_MAX_FRAME)


def test_unexpected_frame_type_and_bad_json() -> None:
    a, b = socket_pair()
    send_json(a, Frame.TOKEN, {"id": 1})
    with pytest.raises(ProtocolError, match="expected HELLO, got TOKEN"):
        recv_json(b, Frame.HELLO)
    send_frame(a, Frame.HELLO, b"{not json")
    with pytest.raises(ProtocolError, match="not valid JSON"):
        recv_json(b, Frame.HELLO)
    send_frame(a, Frame.HELLO, b"[1, 2]")
    with pytest.raises(ProtocolError, match="JSON object"):
        recv_json(b, Frame.HELLO)


def test_peer_hangup_mid_frame() -> None:
    a, b = socket_pair()
    a.sendall(pack_header(Frame.KV_LAYER, 1000) + b"only a little")
    a.close()
    with pytest.raises(ProtocolError, match="closed after 13 of 1000"):
        recv_frame(b)


def test_header_layout_is_fixed() -> None:
    raw = pack_header(Frame.DONE, 258)
    assert len(raw) == 16
    assert raw[:2] == b"DG" and raw[2] == VERSION and raw[3] == Frame.DONE
    assert struct.unpack("<Q", raw[8:]) == (258,)


def test_fingerprint_mismatch_names_fields() -> None:
    fp = {
        "architecture": "llama",
        "num_layers": 30,
        "num_kv_heads": 3,
        "head_dim": 64,
        "dtype": "float32",
        "layers": [["full", 0]] * 30,
    }
    assert fingerprint_mismatch(fp, dict(fp)) == []
    other = {**fp, "num_layers": 2, "layers": [["full", 0]] * 2, "dtype": "bfloat16"}
    diffs = fingerprint_mismatch(fp, other)
    assert any("num_layers 30 vs 2" in d for d in diffs)
    assert any("dtype float32 vs bfloat16" in d for d in diffs)
    sliding = {**fp, "layers": [["sliding", 8]] + [["full", 0]] * 29}
    assert fingerprint_mismatch(fp, sliding) == [
        "layers [0] cache kind/window ['full', 0] vs ['sliding', 8]"
    ]

"""A PREFILL's token ids packed as uint32s (protocol.IDS_U32): sent only to a
prefill agent whose HELLO_OK offers them, read as the same request as JSON ids,
and anything malformed refused with the reason. The real agents' side is in
test_typed_request (they share its pair of agents)."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import pytest

from disagg_agents.decode.kvfetch import Into, PrefillUnavailable, fetch_kv
from disagg_agents.wire.auth import server_auth
from disagg_agents.wire.channel import recv_control, recv_json, send_error, send_json, send_json_ids
from disagg_agents.wire.frames import (
    IDS_U32,
    IDS_U32_CAP,
    Frame,
    Header,
    ProtocolError,
    split_json_ids,
)
from disagg_agents.wire.request import (
    PrefillRequest,
    PrefillTarget,
    RequestError,
    pack_ids,
    unpack_ids,
)


def _roundtrip(obj: dict[str, Any], ids: bytes) -> tuple[Header, bytearray]:
    a, b = socket.socketpair()
    with a, b:
        send_json_ids(a, Frame.PREFILL, obj, ids)
        return recv_control(b, Frame.PREFILL)


def test_packed_ids_read_as_the_same_request_as_json_ids() -> None:
    req = PrefillRequest(
        [0, 7, 49151, 2**32 - 1, 3],
        codec=2,
        kv_quant="int8",
        start=2,
        prefix_digest="ab",
        cache_salt="s",
        cores_busy=True,
    )
    header, payload = _roundtrip(req.to_wire(packed_ids=True), pack_ids(req.token_ids))
    assert header.flags == IDS_U32
    frame, packed = split_json_ids(header, payload)
    assert "token_ids" not in frame and packed is not None and len(packed) == 4 * 5
    assert PrefillRequest.from_dict(frame, None, packed) == req
    assert PrefillRequest.from_dict(req.to_wire()) == req  # the JSON form, unchanged
    assert unpack_ids(pack_ids(list(range(70000)))) == list(range(70000))


def test_a_frame_without_the_flag_is_plain_json() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_json(a, Frame.PREFILL, {"token_ids": [1, 2], "codec": 0})
        frame, packed = split_json_ids(*recv_control(b, Frame.PREFILL))
    assert frame == {"token_ids": [1, 2], "codec": 0} and packed is None


def _header(flags: int, length: int) -> Header:
    return Header(Frame.PREFILL, flags, length)


@pytest.mark.parametrize(
    "flags, payload, why",
    [
        (2, b"{}", "unknown flags"),
        (IDS_U32 | 4, b"{}", "unknown flags"),
        (IDS_U32, b"\x02\x00", "too short"),
        (IDS_U32, b"\x09\x00\x00\x00{}", "not whole uint32s"),  # JSON claims 9 bytes
        (IDS_U32, b"\x02\x00\x00\x00{}\x01\x00\x00", "not whole uint32s"),
        (IDS_U32, b"\x02\x00\x00\x00[]\x01\x00\x00\x00", "JSON object"),
        (IDS_U32, b"\x02\x00\x00\x00{]\x01\x00\x00\x00", "not valid JSON"),
    ],
)
def test_malformed_packed_frames_are_protocol_errors(flags: int, payload: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        split_json_ids(_header(flags, len(payload)), bytearray(payload))


@pytest.mark.parametrize(
    "frame, ids, why",
    [
        ({"token_ids": [1], "codec": 0}, [1], "both"),  # ids twice: which one?
        ({"codec": 0}, [], "non-empty"),
        ({"codec": 0}, [1, 10], "out of range"),  # vocab of 10
        ({"codec": 0, "start": 3}, [1, 2], "start"),
    ],
)
def test_packed_requests_are_checked_like_json_ones(
    frame: dict[str, Any], ids: list[int], why: str
) -> None:
    with pytest.raises(RequestError, match=why) as err:
        PrefillRequest.from_dict(frame, 10, memoryview(pack_ids(ids)))
    assert err.value.field in ("token_ids", "start")


class _Prefill:
    """A prefill agent's handshake (no token), offering packed ids or not; it
    keeps the PREFILL it got and answers with an ERROR."""

    def __init__(self, offer: bool) -> None:
        self.offer = offer
        self.got: tuple[Header, bytearray] | None = None
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn, contextlib.suppress(OSError, ProtocolError):
            conn.settimeout(10)
            server_auth(conn, None)
            recv_json(conn, Frame.HELLO)
            send_json(conn, Frame.HELLO_OK, IDS_U32_CAP if self.offer else {})
            self.got = recv_control(conn, Frame.PREFILL)
            send_error(conn, "busy", "test")

    def ask(self, ids: list[int]) -> tuple[dict[str, Any], memoryview | None]:
        target = PrefillTarget(["127.0.0.1"], self.srv.getsockname()[1], timeout=10)
        hello = {"role": "decode", "fingerprint": {"num_kv_heads": 1, "head_dim": 4}}
        with pytest.raises(PrefillUnavailable, match="busy"):
            fetch_kv(target, PrefillRequest(ids), Into([]), hello)
        self.thread.join(10)
        self.srv.close()
        assert self.got is not None
        return split_json_ids(*self.got)


@pytest.mark.parametrize("offer", [True, False])
def test_the_decode_side_packs_ids_only_for_an_agent_that_offers_it(offer: bool) -> None:
    ids = list(range(1000, 3000))
    frame, packed = _Prefill(offer).ask(ids)
    if offer:
        assert packed is not None and "token_ids" not in frame
    else:  # an older prefill agent: today's JSON
        assert packed is None and frame["token_ids"] == ids
    assert PrefillRequest.from_dict(frame, None, packed).token_ids == ids

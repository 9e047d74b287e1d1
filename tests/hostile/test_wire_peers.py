"""Hostile peers at the wire, without models: deadlines, pre-auth caps, memory
that grows only with what arrives, zstd frames that lie about their size, the
client's refusal to be downgraded, HTTP challenge-response, escaped log lines."""

from __future__ import annotations

import io
import logging
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
import zstandard

from disagg_agents.runtime.args import load_token
from disagg_agents.runtime.control import start_control
from disagg_agents.runtime.logs import OneLineFormatter
from disagg_agents.wire import httpauth
from disagg_agents.wire import kvcodec as K
from disagg_agents.wire.auth import client_auth, server_auth
from disagg_agents.wire.channel import recv_frame, recv_json, send_frame
from disagg_agents.wire.frames import (
    RECV_STEP,
    Deadline,
    DeadlineExceeded,
    Frame,
    Header,
    PeerAuthError,
    PeerClosed,
    ProtocolError,
    decode_json,
    pack_header,
)
from disagg_agents.wire.text import printable
from tests.agenthelpers import FixedStatus, closed_now
from tests.conftest import socket_pair

pytestmark = pytest.mark.fuzz

TOKEN = b"t" * 64


def test_peer_closed_between_frames_but_not_mid_frame() -> None:
    a, b = socket_pair()
    a.close()
    with pytest.raises(PeerClosed):
        recv_json(b, Frame.GENERATE)
    a, b = socket_pair()
    a.sendall(pack_header(Frame.GENERATE, 10)[:5])
    a.close()
    with pytest.raises(ProtocolError, match="closed after 5 of 16") as info:
        recv_json(b, Frame.GENERATE)
    assert not isinstance(info.value, PeerClosed)


def test_a_trickling_peer_is_cut_at_the_handshake_deadline() -> None:
    a, b = socket_pair()
    stop = threading.Event()

    def trickle() -> None:
        recv_json(a, Frame.CHALLENGE)
        raw = pack_header(Frame.AUTH, 200) + b"x" * 200
        for byte in raw:  # one byte every 0.2 s: each recv would be happy
            if stop.wait(0.2):
                return
            try:
                a.send(bytes([byte]))
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        server_auth(b, TOKEN, Deadline(1.0))
    took = time.monotonic() - t0
    # Cut by the deadline: not before it (the bound the code enforces), and before the
    # ~41 s trickle ended (an ordering: the trickler is still sending).
    assert t.is_alive() and took >= 1.0, took
    stop.set()


def test_pre_auth_frames_are_small_and_cost_only_what_arrived() -> None:
    a, b = socket_pair()
    a.sendall(pack_header(Frame.AUTH, 16 << 20))
    with pytest.raises(PeerAuthError, match="exceeds the cap of 4096"):
        server_auth(b, TOKEN, Deadline(2.0))
    # After auth a frame may be large, but its memory grows with its bytes.
    a, b = socket_pair()
    tracemalloc.start()
    try:
        a.sendall(pack_header(Frame.GENERATE, 1 << 30) + b"x" * 1000)
        a.close()
        with pytest.raises(ProtocolError, match="closed after 1000 of 1073741824"):
            recv_frame(b, 2 << 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * RECV_STEP


def test_large_frames_still_arrive_whole() -> None:
    a, b = socket_pair()
    body = bytes(range(256)) * 5000  # several RECV_STEPs
    threading.Thread(target=send_frame, args=(a, Frame.KV_LAYER, body), daemon=True).start()
    header, payload = recv_frame(b)
    assert header.length == len(body) and bytes(payload) == body


@pytest.mark.parametrize(
    "payload", [b"[" * 100_000, b'{"a":' * 100_000, b'{"n": ' + b"9" * 5000 + b"}"]
)
def test_deep_or_odd_json_is_a_protocol_error(payload: bytes) -> None:
    header = Header(Frame.AUTH, 0, len(payload))
    with pytest.raises(ProtocolError):
        decode_json(header, payload)
    a, b = socket_pair()
    send_frame(a, Frame.AUTH, payload[:4000])
    with pytest.raises(PeerAuthError):  # refused, no RecursionError
        server_auth(b, TOKEN, Deadline(2.0))


def test_a_client_with_a_token_refuses_a_server_that_wants_none() -> None:
    a, b = socket_pair()
    threading.Thread(target=server_auth, args=(a, None), daemon=True).start()
    with pytest.raises(PeerAuthError, match="runs without a cluster token.*refusing"):
        client_auth(b, TOKEN)


def test_printable_escapes_and_cuts() -> None:
    assert printable("a\x1b[31mb\nc\rd\x00\u2028") == "a\\x1b[31mb\\nc\\rd\\x00\\u2028"
    assert printable("é ü ok") == "é ü ok"
    assert printable("x" * 500) == "x" * 200 + "..."


def test_log_records_are_one_escaped_line() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("test.oneline")
    logger.addHandler(handler)
    logger.propagate = False
    logger.warning("peer said %s", "evil\n2026 INFO forged\x1b]0;title\x07")
    text = out.getvalue()
    assert text.count("\n") == 1 and "\x1b" not in text and "\x07" not in text
    assert "evil\\n2026 INFO forged\\x1b]0;title\\x07" in text


# -- zstd frames that lie --------------------------------------------------


def with_content_size(frame: bytes, size: int) -> bytes:
    """`frame` (written without a content size) re-headed to declare `size`."""
    desc = frame[4]
    assert desc >> 6 == 0 and not desc & 0x20 and not desc & 3  # window byte, no size, no dict
    # Single segment, 8-byte size: no window descriptor; the blocks follow as they were.
    return frame[:4] + bytes([0xE0 | (desc & 0x04)]) + struct.pack("<Q", size) + frame[6:]


def zstd_layer(declared: int | None, seq: int = 4, real: bytes | None = None) -> bytes:
    """A KV_LAYER payload for [1, seq, 4] float32 K and V whose zstd blocks
    declare `declared` bytes (None: no declaration)."""
    nbytes = seq * 4 * 4
    plain = real if real is not None else b"\0" * nbytes
    block = zstandard.ZstdCompressor(write_content_size=False).compress(plain)
    if declared is not None:
        block = with_content_size(block, declared)
    head = K.LAYER_HEADER.pack(
        0, K.Kind.FULL, K.DType.FLOAT32, K.Codec.ZSTD, 0, 1, seq, 4, 4, len(block), len(block)
    )
    return head + block + block


def test_the_forged_header_is_read_by_zstd() -> None:
    good = zstd_layer(64)
    assert K.decode_layer(good).keys.shape == (1, 4, 4)  # the forged header is valid zstd
    block = zstd_layer(1 << 46)[K.LAYER_HEADER.size :]
    assert zstandard.frame_content_size(block[: len(block) // 2]) == 1 << 46


@pytest.mark.parametrize(
    "payload, why",
    [
        (zstd_layer(1 << 46), "declares 70368744177664 bytes"),
        (zstd_layer(64 << 20), "declares 67108864 bytes"),
        (zstd_layer(63), "declares 63 bytes"),
        (zstd_layer(None, real=b"\0" * (64 << 10)), "bad zstd block|expands"),
        (zstd_layer(None, real=b"\0" * 10), "expands to 10 bytes"),
    ],
)
def test_zstd_blocks_are_capped_by_the_shape_whatever_they_declare(
    payload: bytes, why: str
) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=why):
            K.decode_layer(payload, max_bytes=K.layer_cap(1, 4, 4))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_odd_shapes_are_protocol_errors_not_value_errors() -> None:
    a = np.zeros((1, 3, 4), np.float16)
    parts = K.encode_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT16, a, a), K.Codec.SHUFFLE_ZSTD)
    body = b"".join(bytes(p) for p in parts)
    fields = list(K.LAYER_HEADER.unpack_from(body))
    fields[2] = int(K.DType.FLOAT32)  # itemsize 4 over a 24-byte block: reshape would fail
    with pytest.raises(ProtocolError):
        K.decode_layer(K.LAYER_HEADER.pack(*fields) + body[K.LAYER_HEADER.size :])


# -- token files -------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n", "short-token"])
def test_empty_or_short_token_files_fail_with_one_line(
    tmp_path: pytest.TempPathFactory, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "token"  # type: ignore[operator]
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(SystemExit) as info:
        load_token(str(path))
    assert info.value.code == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"FAILED token file {path} ")
    assert "at least 32" in out and "fix:" in out


# -- HTTP challenge-response ---------------------------------------------------


@pytest.fixture()
def control() -> Iterator[tuple[str, int]]:
    server = start_control(
        "127.0.0.1",
        0,
        lambda: FixedStatus({"role": "decode", "in_flight": 0}),
        lambda: "disagg_up 1\n",
        TOKEN,
        threading.Event(),
        deadline_s=1.0,
    )
    yield "127.0.0.1", server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.auth
def test_http_status_with_challenge_response(control: tuple[str, int]) -> None:
    host, port = control
    assert b'"in_flight"' in httpauth.control_get(host, port, "/status", TOKEN)
    assert b"disagg_up" in httpauth.control_get(host, port, "/metrics", TOKEN)
    assert b'"ok"' in httpauth.control_get(host, port, "/health", None)
    with pytest.raises(PeerAuthError, match="requires the cluster token"):
        httpauth.control_get(host, port, "/status", None)
    with pytest.raises(PeerAuthError, match="refused our proof"):
        httpauth.control_get(host, port, "/status", b"w" * 64)
    with pytest.raises(httpauth.ControlError, match="404"):
        httpauth.control_get(host, port, "/nope", TOKEN)


@pytest.mark.auth
def test_http_answers_are_single_use_and_path_bound(control: tuple[str, int]) -> None:
    import http.client

    host, port = control
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("GET", "/status")
    resp = conn.getresponse()
    resp.read()
    nonce = httpauth.parse_authorization(resp.getheader("WWW-Authenticate"))["nonce"]  # type: ignore[index]
    mac = httpauth._mac(TOKEN, "client", "GET", "/status", nonce, "c1")
    auth = f'Disagg-HMAC nonce="{nonce}", cnonce="c1", mac="{mac}"'

    def status(path: str) -> int:
        c = http.client.HTTPConnection(host, port, timeout=5)
        c.request("GET", path, headers={"Authorization": auth})
        r = c.getresponse()
        r.read()
        c.close()
        return r.status

    assert status("/metrics") == 401  # the MAC names /status
    assert status("/status") == 200
    assert status("/status") == 401  # a replay


@pytest.mark.auth
def test_a_client_with_a_token_refuses_an_http_server_without_one() -> None:
    server = start_control(
        "127.0.0.1",
        0,
        lambda: FixedStatus({"x": 1}),
        lambda: "",
        None,
        threading.Event(),
        deadline_s=1.0,
    )
    try:
        with pytest.raises(PeerAuthError, match="asks for no cluster token"):
            httpauth.control_get("127.0.0.1", server.server_address[1], "/status", TOKEN)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.fault
def test_http_tricklers_are_cut_and_connections_capped(control: tuple[str, int]) -> None:
    host, port = control
    t0 = time.monotonic()
    s = socket.create_connection((host, port), timeout=5)
    s.settimeout(None)  # else Python waits for data before a MSG_DONTWAIT recv
    s.sendall(b"GET /sta")
    was_cut = False
    for _ in range(300):  # a byte every 0.1 s for 30 s: the per-read timeout never fires
        time.sleep(0.1)
        try:
            s.sendall(b"t")
            if s.recv(1, socket.MSG_DONTWAIT) == b"":
                was_cut = True
                break
        except BlockingIOError:
            continue
        except OSError:
            was_cut = True
            break
    cut = time.monotonic() - t0
    s.close()
    # The server hung up while bytes kept coming (before the 30 s trickle ended), not
    # before its 1 s request deadline.
    assert was_cut and cut >= 1.0, cut
    # More than CONTROL_MAX_PER_PEER at once from one address: the rest are closed at once.
    # (A stranger's address: loopback is the local pair's, with slots of its own.)
    from disagg_agents.runtime.control import CONTROL_MAX_PER_PEER

    src = ("127.0.0.3", 0)
    held = [
        socket.create_connection((host, port), timeout=5, source_address=src)
        for _ in range(CONTROL_MAX_PER_PEER)
    ]
    time.sleep(0.2)
    extra = socket.create_connection((host, port), timeout=30, source_address=src)
    # Closed before it sent a byte, so not by the 1 s request deadline: that needs a
    # request under way; and while the silent ones it is over the cap of stay open
    # (an ordering: no deadline of theirs closed it).
    try:
        answer = extra.recv(64)
    except ConnectionResetError:
        answer = b""
    assert answer == b"", "a connection over the per-peer cap was served"
    assert not any(closed_now(h) for h in held), "the held connections were closed too"
    # Another address is still served meanwhile.
    with socket.create_connection((host, port), 5, source_address=("127.0.0.2", 0)) as other:
        other.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert other.recv(64).startswith(b"HTTP/1.0 200")
    for h in [*held, extra]:
        h.close()

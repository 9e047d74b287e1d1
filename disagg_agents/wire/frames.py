"""Frames between disagg clients, decode agents and prefill agents: their types,
header, errors and JSON payloads. Bytes only: nothing here imports torch or mlx.

Every frame is a fixed 16-byte header followed by a payload:

    magic "DG" | version u8 | type u8 | flags u8 | 3 pad | payload length u64

Control payloads (hello, requests, metrics, errors) are small JSON objects.
KV payloads are binary (see `kvcodec`); tensors never travel as JSON or base64.
Sending and receiving them on a socket is `channel`'s job.
"""

from __future__ import annotations

import enum
import json
import struct
import time
from dataclasses import dataclass
from typing import Any

from disagg_agents.wire.text import printable

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
# A PREFILL flag: the JSON (without token_ids) is length-prefixed and the token
# ids follow it as little-endian uint32s, 4 bytes each instead of JSON text that
# both sides spent ~0.2 ms each on for 2,000 ids. Sent only to a prefill agent
# whose HELLO_OK says IDS_U32_CAP.
IDS_U32 = 1
IDS_U32_CAP = {"ids": "u32"}
JSON_LEN = struct.Struct("<I")


def packed_ids_offered(hello_ok: dict[str, Any]) -> bool:
    return all(hello_ok.get(k) == v for k, v in IDS_U32_CAP.items())


class Frame(enum.IntEnum):
    HELLO = 1  # {"version", "role", "fingerprint", "model"}
    HELLO_OK = 2  # {"role", "fingerprint", "model", "server"}
    PREFILL = 3  # {"request_id", "token_ids", "codec", "kv_quant"}
    KV_LAYER = 4  # binary, see kvcodec
    PREFILL_DONE = 5  # {"prefill_time", "tokens", "last_layer_at", ...}
    GENERATE = 6  # client -> decode agent: the request
    TOKEN = 7  # {"id", "text", "channel"?, "tool_call"?}: answer.TokenEvent
    DONE = 8  # {"text", "token_ids", "metrics", ...}: answer.Done
    ERROR = 9  # {"code", "message"}
    LOGPROBS = 10  # binary float32 vector, only when a request asks for it
    CHALLENGE = 11  # server -> client, first frame of every connection: {"nonce", "auth"}
    AUTH = 12  # client -> server: {"nonce", "mac"}
    AUTH_OK = 13  # server -> client: {"mac"}, the server's proof
    LOGITS = 14  # prefill -> decode: float32 logits of the prompt's last position
    # decode -> client, only when the GENERATE asked for it (its progress_s): "still
    # working" while no token is due, {"phase": "queued"|"prefill"|"decode", ...}.
    PROGRESS = 15
    # client -> prefill agent, after a HELLO with role "embed": {"input": [text],
    # "truncate": bool, "max_tokens": int | None}; one forward, no K/V sent.
    EMBED = 16
    EMBEDDING = 17  # prefill -> client: {"embeddings": [[float]], "prompt_tokens", "pooling"}


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame, or hung up."""


class PeerClosed(ProtocolError):
    """The peer hung up cleanly between two frames (before a header's first byte)."""


class DeadlineExceeded(ProtocolError):
    """The peer did not finish in time (the handshake deadline, for instance)."""


class PeerAuthError(Exception):
    """A peer failed to prove it holds the cluster token (or we have none to prove)."""


class RemoteError(Exception):
    """The peer answered with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


def json_bytes(obj: dict[str, Any]) -> bytes:
    """A control frame's JSON, compact."""
    return json.dumps(obj, separators=(",", ":")).encode()


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


def split_json_ids(header: Header, payload: bytearray) -> tuple[dict[str, Any], memoryview | None]:
    """A control frame's JSON object, and with IDS_U32 the packed ids after it
    (None without). Unknown flags are refused: they would change the meaning."""
    if header.flags & ~IDS_U32:
        raise ProtocolError(f"{header.type.name} frame with unknown flags {header.flags:#x}")
    if not header.flags & IDS_U32:
        return decode_json(header, payload), None
    view = memoryview(payload)
    if len(view) < JSON_LEN.size:
        raise ProtocolError(f"{header.type.name} frame too short for its JSON's length")
    end = JSON_LEN.size + JSON_LEN.unpack_from(view)[0]
    if end > len(view) or (len(view) - end) % 4:
        raise ProtocolError(f"{header.type.name} frame's ids are not whole uint32s")
    return decode_json(header, view[JSON_LEN.size : end]), view[end:]

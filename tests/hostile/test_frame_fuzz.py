"""Hostile bytes: >= 100,000 random and mutated frames at the frame parser, and
>= 1,000 at live agents' ports. Nothing crashes, hangs, or allocates past the cap;
each bad frame gets an ERROR frame or a closed connection; the agents then serve
a correct request."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.serving.localagents import AgentProc
from disagg_agents.wire import kvcodec as K
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import recv_frame, recv_json
from disagg_agents.wire.frames import Frame, ProtocolError, decode_json, pack_header
from tests.agenthelpers import rss_kb
from tests.conftest import PairFactory, ask
from tests.tinymodels import PROMPT, shared_tiny

pytestmark = pytest.mark.fuzz

CAP = 1 << 20  # the parser's frame cap in these tests


class ByteSock:
    """Just enough of a socket for recv_frame: reads from a bytes buffer."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0

    def recv_into(self, buf: memoryview, n: int) -> int:
        chunk = self.data[self.at : self.at + n]
        buf[: len(chunk)] = chunk
        self.at += len(chunk)
        return len(chunk)


def parse_all(data: bytes) -> int:
    """Parse frames until the stream ends or breaks; only ProtocolError may escape."""
    sock = ByteSock(data)
    frames = 0
    while True:
        header, payload = recv_frame(sock, CAP)  # type: ignore[arg-type]
        if header.type == Frame.KV_LAYER:
            K.decode_layer(payload, max_bytes=CAP)
        elif header.type not in (Frame.LOGPROBS,):
            decode_json(header, payload)
        frames += 1


def valid_frames() -> list[bytes]:
    a = np.arange(2 * 5 * 4, dtype=np.float32).reshape(2, 5, 4)
    out = [
        pack_header(Frame.HELLO, 27) + b'{"role":"decode","model":1}',
        pack_header(Frame.PREFILL, 28) + b'{"token_ids":[1,2,3],"codec"}',
        pack_header(Frame.TOKEN, 22) + b'{"id": 5, "text": "x"}',
    ]
    for codec in K.Codec:
        layer = K.encode_layer(K.LayerKV(3, K.Kind.FULL, K.DType.FLOAT32, a, a), codec)
        body = b"".join(bytes(b) for b in layer)
        out.append(pack_header(Frame.KV_LAYER, len(body)) + body)
    return out


def mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    how = rng.randrange(6)
    if how == 0:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif how == 1:  # truncate
        del b[rng.randrange(len(b)) :]
    elif how == 2:  # lie about the length
        struct.pack_into("<Q", b, 8, rng.choice([0, 1, len(b), CAP, CAP + 1, 1 << 40, 2**64 - 1]))
    elif how == 3:  # another frame type
        b[3] = rng.randrange(256)
    elif how == 4:  # scramble the KV sub-header (shape, dtype, codec, lengths)
        for _ in range(4):
            i = 16 + rng.randrange(min(K.LAYER_HEADER.size, max(1, len(b) - 16)))
            if i < len(b):
                b[i] = rng.randrange(256)
    else:  # splice random bytes in
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 64))
    return bytes(b)


def test_hundred_thousand_hostile_frames_at_the_parser() -> None:
    rng = random.Random(1234)
    base = valid_frames()
    outcomes = {"parsed": 0, "refused": 0}
    for i in range(100_000):
        if i % 2:
            data = mutate(rng, rng.choice(base))
            if rng.random() < 0.3:  # a good frame after a bad one must not be reached
                data += rng.choice(base)
        else:
            data = rng.randbytes(rng.randint(0, 96))
            if rng.random() < 0.5:  # random bytes behind a plausible header
                data = pack_header(Frame(rng.randint(1, 13)), rng.randint(0, 80)) + data
        try:
            outcomes["parsed"] += parse_all(data)
        except ProtocolError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 90_000  # nearly every input is refused, none crashes


def test_a_huge_claimed_length_allocates_nothing() -> None:
    tracemalloc.start()
    try:
        for claim in (CAP + 1, 1 << 33, 2**64 - 1):
            with pytest.raises(ProtocolError, match="exceeds the cap"):
                parse_all(pack_header(Frame.KV_LAYER, claim) + b"\0" * 64)
        a = np.zeros((1, 1, 4), np.float32)
        bomb = K.encode_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, a, a), K.Codec.ZSTD)
        head = list(K.LAYER_HEADER.unpack(bytes(bomb[0])))
        head[5] = 1 << 28  # claims a quarter-billion tokens behind a few compressed bytes
        body = K.LAYER_HEADER.pack(*head) + bytes(bomb[1]) + bytes(bomb[2])
        with pytest.raises(ProtocolError, match="over the cap"):
            K.decode_layer(body, max_bytes=CAP)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * CAP


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_any_bytes_parse_or_are_refused(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_all(data)


# -- live agents ------------------------------------------------------------


@pytest.fixture(scope="module")
def agents(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(shared_tiny("qwen3"))


def answer(s: socket.socket) -> str:
    """Read until the agent answers ERROR, ends the request, or closes."""
    while True:
        try:
            header, payload = recv_frame(s, 64 << 20)
        except (ProtocolError, OSError):
            return "closed"
        if header.type == Frame.ERROR:
            return "error"
        if header.type in (Frame.DONE, Frame.PREFILL_DONE, Frame.HELLO_OK):
            return "served"


def hostile_session(agent: AgentProc, rng: random.Random, base: list[bytes]) -> str:
    with socket.create_connection((agent.host, agent.port), timeout=20) as s:
        authed = rng.random() < 0.8  # most frames reach the request parser behind auth
        if authed:
            # Untagged frames, so mutated bytes reach the request parser (a sealed
            # connection would refuse them all at the tag, before parsing).
            client_auth(s, agent.token, "none")
        else:
            recv_json(s, Frame.CHALLENGE)
        data = mutate(rng, rng.choice(base)) if rng.random() < 0.7 else rng.randbytes(40)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # nothing more is coming: the agent must not wait
        except OSError:
            return "closed"  # the agent already hung up on what it saw
        return answer(s)


def requests_for(role: str) -> list[bytes]:
    def frame(kind: Frame, obj: object) -> bytes:
        raw = json.dumps(obj).encode()
        return pack_header(kind, len(raw)) + raw

    if role == "decode":
        return [
            frame(Frame.GENERATE, {"prompt": "hi", "raw": True, "max_tokens": 2}),
            frame(Frame.GENERATE, {"messages": [{"role": "user", "content": "x"}]}),
        ]
    return [
        frame(Frame.HELLO, {"role": "decode", "fingerprint": {"num_layers": 1}}),
        *valid_frames()[3:],
    ]


@pytest.mark.slow
def test_a_thousand_hostile_frames_at_each_live_agent(
    agents: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = agents
    good = {
        "prompt": PROMPT,
        "raw": True,
        "max_tokens": 8,
        "placement": "remote",
        "prefill": {"host": prefill.host, "port": prefill.port},
    }
    before = ask(decode, good)
    rss0 = {a.role: rss_kb(a) for a in agents}
    rng = random.Random(99)
    t0 = time.monotonic()
    for agent in agents:
        base = requests_for(agent.role)
        seen = {"error": 0, "closed": 0, "served": 0}
        for _ in range(1000):
            seen[hostile_session(agent, rng, base)] += 1
        print(agent.role, seen)
        assert seen["error"] + seen["closed"] >= 900, seen
        assert agent.alive(), agent.role
    assert time.monotonic() - t0 < 600  # hang guard
    after = ask(decode, good)
    assert after.token_ids == before.token_ids and after.metrics.method == "disaggregated"
    for agent in agents:
        grown_mb = (rss_kb(agent) - rss0[agent.role]) / 1024
        assert grown_mb < 64, f"{agent.role} grew {grown_mb:.0f} MB"
        assert json.loads(agent.control("/status"))["in_flight"] == 0

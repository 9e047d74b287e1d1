"""One typed request end to end: the front doors build a `GenerateRequest`, the
decode agent asks for K/V with a typed `PrefillRequest`, and the wire is today's
(JSON sent by hand as earlier releases sent it gets the same answers)."""

from __future__ import annotations

import ast
import socket
from pathlib import Path
from typing import Any

import pytest

from disagg.serving import wireclient
from disagg.serving.localagents import AgentProc
from disagg.serving.metrics import SEED_NAMES, Metrics
from disagg.serving.pair import run_remote
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import recv_frame, recv_json, send_frame, send_json, send_json_ids
from disagg_agents.wire.frames import Frame, decode_json, error_from, packed_ids_offered
from disagg_agents.wire.request import (
    GenerateRequest,
    PrefillRequest,
    PrefillTarget,
    RequestError,
    pack_ids,
)
from tests.conftest import PairFactory
from tests.tinymodels import PROMPT, shared_tiny

REPO = Path(__file__).resolve().parent.parent


# ---- PREFILL: checked once, same JSON as before -------------------------------------------


def test_prefill_request_round_trips_todays_json() -> None:
    today = {"token_ids": [1, 2, 3, 4], "codec": 2, "kv_quant": "int8", "probe_codecs": True}
    req = PrefillRequest.from_dict(today, vocab_size=10)
    assert req.to_wire() == today
    assert PrefillRequest([5], codec=0).to_wire() == {"token_ids": [5], "codec": 0}
    hit = {"token_ids": [1, 2, 3], "codec": 0, "start": 2, "prefix_digest": "ab"}
    assert PrefillRequest.from_dict(hit).to_wire() == hit
    off = {"token_ids": [1], "codec": 1, "prefix_cache": False}
    assert PrefillRequest.from_dict(off).to_wire() == off


@pytest.mark.parametrize(
    "frame, field",
    [
        ([1, 2], "request"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, True]}, "token_ids"),
        ({"token_ids": [1, 99]}, "token_ids"),  # vocab of 10
        ({"token_ids": [1], "codec": 7}, "codec"),
        ({"token_ids": [1], "codec": "auto"}, "codec"),  # resolved before the wire
        ({"token_ids": [1], "kv_quant": "int4"}, "kv_quant"),
        ({"token_ids": [1, 2], "start": 2}, "start"),
        ({"token_ids": [1, 2], "start": 1, "prefix_digest": 5}, "prefix_digest"),
    ],
)
def test_prefill_request_refuses_with_the_field(frame: Any, field: str) -> None:
    with pytest.raises(RequestError) as err:
        PrefillRequest.from_dict(frame, vocab_size=10)
    assert err.value.field == field


def test_generate_request_replace_is_typed_and_checked() -> None:
    req = GenerateRequest(prompt="hi")
    target = PrefillTarget(["127.0.0.1"], 9000, 5.0, "p")
    moved = req.replace(prefill=target, placement="remote")
    assert moved.prefill is target and moved.to_wire()["prefill"]["port"] == 9000
    with pytest.raises(RequestError):
        req.replace(temperature=9.0)
    # Fields with a typed target, as a caller holding one builds a request.
    assert GenerateRequest.from_dict({"prompt": "hi", "prefill": target}).prefill is target


def test_metrics_keep_the_wire_names() -> None:
    wire = {"prompt_tokens": 3, "method": "local", "cached_tokens": 0, "from_the_future": 1}
    m = Metrics.from_json(wire)
    assert m.prompt_tokens == 3 and m.method == "local" and m.extra["from_the_future"] == 1
    out = m.to_json()
    assert all(name in out for name in SEED_NAMES)  # the seed's names, always
    assert {k: out[k] for k in wire} == wire
    assert "fallback_reason" not in out and m.fallback_reason is None


# ---- no dicts into the API, one prefill target --------------------------------------------


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]


def test_no_generate_call_in_disagg_takes_a_dict_of_fields() -> None:
    bad = []
    for path in sorted((REPO / "disagg").rglob("*.py")):
        for call in _calls(path):
            name = getattr(call.func, "attr", getattr(call.func, "id", ""))
            if name in ("generate", "agenerate") and any(k.arg is None for k in call.keywords):
                bad.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert bad == []


def test_the_prefill_target_is_built_in_one_place() -> None:
    built = []
    for path in sorted((REPO / "disagg").rglob("*.py")):
        for call in _calls(path):
            if getattr(call.func, "id", "") == "PrefillTarget":
                built.append(path.relative_to(REPO).as_posix())
            # a target as a hand-made dict: {"hosts": ..., "port": ...}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if {"port"} <= keys and keys & {"host", "hosts"}:
                    built.append(f"dict in {path.relative_to(REPO).as_posix()}")
    assert sorted(set(built)) == ["disagg/serving/router.py"]


# ---- the wire: today's JSON, today's answers ----------------------------------------------


@pytest.fixture(scope="module")
def pair(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(shared_tiny("llama"))


def test_todays_generate_json_gets_the_typed_requests_answer(
    pair: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = pair
    today = {
        "prompt": PROMPT,
        "raw": True,
        "max_tokens": 8,
        "ignore_eos": True,
        "placement": "remote",
        "prefix_cache": False,
        "prefill": {"host": prefill.host, "port": prefill.port},
    }
    by_hand = wireclient.generate(decode.host, decode.port, today, token=decode.token)
    typed = GenerateRequest(
        prompt=PROMPT, raw=True, max_tokens=8, ignore_eos=True, prefix_cache=False
    )
    via_pair = run_remote(prefill, decode, typed)
    assert by_hand.metrics.method == via_pair.metrics.method == "disaggregated"
    assert len(by_hand.token_ids) == 8 and by_hand.token_ids == via_pair.token_ids
    assert by_hand.text == via_pair.text


def test_todays_prefill_json_gets_layers_logits_and_done(
    pair: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = pair
    fingerprint = decode.status()["fingerprint"]
    hello = {"role": "decode", "fingerprint": fingerprint, "model": "test"}
    with socket.create_connection((prefill.host, prefill.port), timeout=30) as sock:
        client_auth(sock, prefill.token)
        send_json(sock, Frame.HELLO, hello)
        recv_json(sock, Frame.HELLO_OK)
        send_json(sock, Frame.PREFILL, {"token_ids": [1, 2, 3, 4, 5], "codec": 0})
        kinds: list[Frame] = []
        while True:
            header, payload = recv_frame(sock)
            kinds.append(header.type)
            if header.type == Frame.PREFILL_DONE:
                done = decode_json(header, payload)
                break
        layers = fingerprint["num_layers"]
        assert kinds == [Frame.KV_LAYER] * layers + [Frame.LOGITS, Frame.PREFILL_DONE]
        assert done["codec"] == 0 and done["kv_quant"] is None and done["prefill_time"] > 0
        # A bad PREFILL on the same kind of connection: one bad_request, agent healthy.
        send_json(sock, Frame.PREFILL, {"token_ids": [1, 2], "start": 5})
        header, payload = recv_frame(sock)
        assert header.type == Frame.ERROR
        error = error_from(header, payload)
    assert error.code == "bad_request" and "start" in error.message
    assert prefill.alive() and prefill.status()["loaded"] is True


def _stream(sock: socket.socket) -> list[tuple[Frame, bytes]]:
    """One PREFILL's answer: every frame up to PREFILL_DONE (payloads as bytes)."""
    frames: list[tuple[Frame, bytes]] = []
    while not frames or frames[-1][0] != Frame.PREFILL_DONE:
        header, payload = recv_frame(sock)
        if header.type == Frame.ERROR:
            raise error_from(header, payload)
        frames.append((header.type, bytes(payload)))
    return frames


def test_packed_ids_get_the_same_layers_and_logits_as_json_ids(
    pair: tuple[AgentProc, AgentProc],
) -> None:
    """Packed ids (protocol.IDS_U32), which the agent offers in HELLO_OK, are the
    same request as JSON ids: the same K/V and logits, byte for byte. A PREFILL
    with a flag the agent does not know is refused; the agent stays healthy."""
    prefill, decode = pair
    fingerprint = decode.status()["fingerprint"]
    hello = {"role": "decode", "fingerprint": fingerprint, "model": "test"}
    req = PrefillRequest([5, 17, 2, 99, 4, 8], prefix_cache=False)
    with socket.create_connection((prefill.host, prefill.port), timeout=30) as sock:
        client_auth(sock, prefill.token)
        send_json(sock, Frame.HELLO, hello)
        _, ok = recv_json(sock, Frame.HELLO_OK)
        assert packed_ids_offered(ok)
        send_json(sock, Frame.PREFILL, req.to_wire())
        as_json = _stream(sock)
        send_json_ids(sock, Frame.PREFILL, req.to_wire(True), pack_ids(req.token_ids))
        packed = _stream(sock)
        kv = [(t, p) for t, p in as_json if t in (Frame.KV_LAYER, Frame.LOGITS)]
        assert len(kv) == fingerprint["num_layers"] + 1
        assert kv == [(t, p) for t, p in packed if t in (Frame.KV_LAYER, Frame.LOGITS)]
        send_frame(sock, Frame.PREFILL, b'{"token_ids":[1]}', flags=2)
        header, payload = recv_frame(sock)
        error = error_from(header, payload)
    assert error.code == "protocol" and "unknown flags" in error.message
    assert prefill.alive() and prefill.status()["loaded"] is True

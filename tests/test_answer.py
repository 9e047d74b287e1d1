"""The answer contract (disagg_agents.wire.answer) and the one response_format normalizer.

TOKEN and DONE frames round-trip through `TokenEvent`, `Done` and `Metrics` on a
real socket pair, from a fake agent of another release through the wire client,
and from a real decode agent; each front door's output-format shape goes through
`GenerateRequest.normalize_format` with one rule for `strict`."""

from __future__ import annotations

import ast
import json
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import UsageError
from disagg.serving import wireclient
from disagg.serving.localagents import AgentProc
from disagg.serving.router import cut_short
from disagg_agents.chatformat import ParsedCall, Piece
from disagg_agents.decode.tokenframes import send_events, token_events
from disagg_agents.runtime.control import start_control
from disagg_agents.runtime.metrics import Stats
from disagg_agents.runtime.report import DecodeStatus, PrefillStatus, StatusReport
from disagg_agents.wire.answer import CONTENT, REASONING, Done, Metrics, TokenEvent, ToolCall
from disagg_agents.wire.auth import client_auth, server_auth
from disagg_agents.wire.channel import recv_frame, recv_json, send_json
from disagg_agents.wire.frames import Frame, ProtocolError, decode_json
from disagg_agents.wire.httpauth import control_get
from disagg_agents.wire.request import GenerateRequest, RequestError
from disagg_agents.wire.status import AgentStatus, MoePath
from disagg_agents.wire.timeline import Timeline
from tests.conftest import PairFactory
from tests.tinymodels import PROMPT

REPO = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


# ---- the frames on a socket --------------------------------------------------------------


def test_token_frames_round_trip_on_a_socket() -> None:
    call = ParsedCall("get_weather", {"city": "Paris"})
    events: list[Piece | ParsedCall] = [
        Piece(REASONING, "hm"),
        Piece(REASONING, "m"),
        Piece(CONTENT, "Hi"),
        call,
    ]
    sent = token_events(7, events)
    assert sent == [
        TokenEvent(7, "hmm", REASONING),  # one frame per run of a channel; the id on the first
        TokenEvent(None, "Hi"),
        TokenEvent(None, "", CONTENT, ToolCall("get_weather", {"city": "Paris"})),
    ]
    assert token_events(8, []) == [TokenEvent(8)]  # one frame per token, even when empty
    assert token_events(None, []) == []
    a, b = pair()
    with a, b:
        send_events(a, 7, events)
        got = []
        for _ in sent:
            header, payload = recv_frame(b)
            assert header.type == Frame.TOKEN
            got.append(TokenEvent.from_json(decode_json(header, payload)))
    assert got == sent
    # The JSON is the releases' that sent dicts: no channel on the answer's text.
    assert sent[1].to_json() == {"id": None, "text": "Hi"}
    assert sent[0].to_json() == {"id": 7, "text": "hmm", "channel": "reasoning"}


def test_the_first_tokens_metrics_ride_flat_and_come_back_typed() -> None:
    early = Metrics(prompt_tokens=9, method="local", ttft=0.25)
    early.timeline = Timeline(at=1700000000.0, first_token=0.25)
    sent = token_events(3, [Piece(CONTENT, "a"), Piece(REASONING, "b")], early)
    assert sent[0].metrics is early and sent[1].metrics is None
    wire = sent[0].to_json()["metrics"]
    assert wire["at"] == 1700000000.0 and wire["first_token"] == 0.25 and "timeline" not in wire
    a, b = pair()
    with a, b:
        send_json(a, Frame.TOKEN, sent[0].to_json())
        _, raw = recv_json(b, Frame.TOKEN)
    back = TokenEvent.from_json(raw)
    assert back == sent[0] and back.metrics is not None and back.metrics.extra == {}


def test_done_frame_round_trips_on_a_socket() -> None:
    metrics = Metrics(prompt_tokens=5, completion_tokens=2, method="local", finish_reason="stop")
    metrics.timeline = Timeline(at=1.0, first_token=0.5)
    done = Done("Paris.", [11, 12], metrics, "thinking", [ToolCall("f", {}, "{ }")], [1, 2])
    a, b = pair()
    with a, b:
        send_json(a, Frame.DONE, done.to_json())
        _, raw = recv_json(b, Frame.DONE)
    back = Done.from_json(raw)
    assert back == done and back.finish_reason == "stop"
    assert raw["metrics"]["method"] == "local" and "fallback_reason" not in raw["metrics"]
    # What a plain answer leaves out is left out of the frame.
    assert set(Done("x", [1], Metrics()).to_json()) == {"text", "token_ids", "metrics"}


# What the decode agent's events stage writes for a remote prefill whose K/V never
# arrived and an answer that ended with its first token: phases it had not, absent;
# phases it named without a time, null.
REMOTE_TIMELINE = {
    "at": 1700000000.5,
    "prefill_start": 0.012,
    "prefill_end": 0.4,
    "kv_first": None,
    "kv_last": None,
    "first_token": 0.41,
    "joined": None,
    "done": 0.41,
}


def test_a_timeline_round_trips_as_the_same_document() -> None:
    t = Timeline.from_json(REMOTE_TIMELINE)
    assert (t.at, t.prefill_end, t.kv_first, t.joined) == (1700000000.5, 0.4, None, None)
    assert Timeline.from_json(t.as_json()) == t
    assert json.dumps(t.as_json()) == json.dumps(REMOTE_TIMELINE)  # keys, order, nulls
    # Inside the metrics, through their JSON and a socket, as a DONE frame carries it.
    m = Metrics(prompt_tokens=3, timeline=t)
    a, b = pair()
    with a, b:
        send_json(a, Frame.DONE, Done("x", [1], m).to_json())
        _, raw = recv_json(b, Frame.DONE)
    assert raw["metrics"]["timeline"] == REMOTE_TIMELINE
    assert Done.from_json(raw).metrics.timeline == t
    # The first token's (at, first_token) and the router's (plus done) are shorter.
    early = Timeline(at=1.0, first_token=0.5)
    assert early.as_json() == {"at": 1.0, "first_token": 0.5}
    assert replace(early, done=2.0).as_json() == {"at": 1.0, "first_token": 0.5, "done": 2.0}
    # A null asked for on a phase that has a time is no null.
    assert Timeline(at=1.0, joined=0.2, nulls=frozenset({"joined", "nope"})).nulls == frozenset()


def test_a_mistyped_timeline_phase_costs_only_itself() -> None:
    sent = {**REMOTE_TIMELINE, "first_token": "soon", "joined": True, "kv_last": [1], "x": 1}
    t = Timeline.from_json(sent)
    assert (t.first_token, t.joined, t.kv_last) == (None, None, None)
    assert (t.at, t.prefill_start, t.done) == (1700000000.5, 0.012, 0.41)
    assert t.as_json() == {**REMOTE_TIMELINE, "first_token": None}  # named, no time
    # A timeline that is no object costs the metrics that field alone.
    for hostile in ("soon", [1.0, 2.0], 3):
        m = Metrics.from_json({"prompt_tokens": 4, "timeline": hostile})
        assert m.timeline is None and m.prompt_tokens == 4 and m.extra == {}
    # An empty one stays the empty object it was sent as.
    assert Metrics.from_json({"timeline": {}}).to_json()["timeline"] == {}


def test_a_request_cut_short_gets_its_done_from_the_router() -> None:
    first = Timeline(at=1700000000.0, first_token=0.5)
    early = Metrics(prompt_tokens=3, timeline=first)
    now = time.perf_counter()
    m = cut_short(early, now - 2.0, now - 1.0, 4, "stop")
    assert m.decode_time is not None and m.timeline == replace(first, done=0.5 + m.decode_time)
    assert m.timeline.as_json() == {"at": 1700000000.0, "first_token": 0.5, "done": m.timeline.done}
    assert early.timeline is first and first.done is None  # the first token's own, untouched
    # No `at` from the agent: nothing to place on the axis.
    headless = Metrics(timeline=Timeline(first_token=0.5))
    assert cut_short(headless, now - 2.0, now - 1.0, 4, "stop").timeline is None


def test_the_answer_is_read_by_attribute_only() -> None:
    # No dict interface: a string key read would hide a misspelt or renamed field.
    m = Metrics(method="local")
    assert not any(hasattr(m, name) for name in ("get", "__getitem__", "__contains__", "to_dict"))
    with pytest.raises(TypeError):
        m["method"]  # type: ignore[index]
    call = ToolCall("f", {"a": 1})
    assert not hasattr(call, "get") and not hasattr(call, "__getitem__")


def test_tool_calls_keep_the_models_text_and_its_wire_json() -> None:
    written = ToolCall("f", {"a": 1}, '{"a":1}')
    assert written.arguments_json == '{"a":1}'  # byte-exact, as the model wrote it
    assert ToolCall("f", {"a": 1}).arguments_json == '{"a": 1}'
    wire = {"name": "f", "arguments": {"a": 1}, "arguments_text": '{"a":1}'}
    assert written.to_json() == wire and ToolCall.from_json(wire) == written
    assert ToolCall("f", {}).to_json() == {"name": "f", "arguments": {}}
    event = TokenEvent.from_json({"id": None, "text": "", "tool_call": wire})
    assert event.tool_call == written and event.to_json()["tool_call"] == wire
    with pytest.raises(ProtocolError):
        TokenEvent.from_json({"id": None, "text": "", "tool_call": {"arguments": {}}})


def test_other_releases_frames_parse_and_keep_unknown_metrics() -> None:
    older = {
        "text": "hi",
        "token_ids": [3],
        "metrics": {"prompt_tokens": 2, "method": "disaggregated", "kv_gpu_ms": 1.5},
    }
    done = Done.from_json(older)
    assert (done.reasoning, done.tool_calls, done.prompt_ids) == ("", [], None)
    assert done.metrics.extra == {"kv_gpu_ms": 1.5} and done.metrics.extra["kv_gpu_ms"] == 1.5
    assert done.metrics.to_json()["kv_gpu_ms"] == 1.5  # passed on, not dropped
    assert Done.from_json(done.to_json()) == done
    # A newer agent's TOKEN keys are ignored; an older one's missing keys take defaults.
    assert TokenEvent.from_json({"id": 4, "text": "a", "logit": 0.1}) == TokenEvent(4, "a")
    assert TokenEvent.from_json({"id": None}) == TokenEvent()
    for bad in ({"id": "4"}, {"id": True}, {"text": 5}, {"tool_call": "f"}):
        with pytest.raises(ProtocolError):
            TokenEvent.from_json(bad)
    with pytest.raises(ProtocolError):
        Done.from_json({"text": 1, "token_ids": []})


def test_an_older_agents_metrics_reach_the_client_through_the_wire() -> None:
    """A fake decode agent of another release on a real port: its TOKEN frames have
    no channel, its DONE metrics a name this release does not know."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: dict[str, Any] = {}

    def agent() -> None:
        conn, _ = listener.accept()
        with conn:
            server_auth(conn, None)
            _, seen["generate"] = recv_json(conn, Frame.GENERATE)
            send_json(conn, Frame.PROGRESS, {"phase": "prefill"})
            for tid, text in ((5, "Par"), (6, "is")):
                send_json(conn, Frame.TOKEN, {"id": tid, "text": text})
            metrics = {"prompt_tokens": 3, "completion_tokens": 2, "old_metric": [1, 2]}
            send_json(conn, Frame.DONE, {"text": "Paris", "token_ids": [5, 6], "metrics": metrics})

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    events: list[TokenEvent] = []
    with listener:
        result = wireclient.generate(
            "127.0.0.1", port, GenerateRequest(prompt="hi"), on_token=events.append, timeout_s=9
        )
    thread.join(5)
    assert [e.id for e in events] == result.token_ids == [5, 6]
    assert all(not e.is_reasoning for e in events) and result.text == "Paris"
    assert result.metrics.extra == {"old_metric": [1, 2]}
    assert result.metrics.ttft is not None and result.finish_reason == "stop"
    # progress_s is the request's field, sent under the name older agents read.
    assert seen["generate"]["progress_s"] == 3.0 and seen["generate"]["prompt"] == "hi"


def test_progress_s_is_a_checked_request_field() -> None:
    assert GenerateRequest.from_dict({"prompt": "x", "progress_s": 0.5}).progress_s == 0.5
    for bad in (0, -1, "1", True):
        with pytest.raises(RequestError) as err:
            GenerateRequest.from_dict({"prompt": "x", "progress_s": bad})
        assert err.value.field == "progress_s"
    assert "progress_s" not in GenerateRequest(prompt="x").to_wire()


# ---- one request through a real agent pair ------------------------------------------------


@pytest.fixture(scope="module")
def agents(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair("llama", seed=3)


@pytest.mark.slow
def test_a_real_agents_frames_go_through_the_contract(
    agents: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = agents
    wire = {
        "prompt": PROMPT,
        "raw": True,
        "max_tokens": 6,
        "ignore_eos": True,
        "placement": "remote",
        "return_prompt_ids": True,
        "prefill": {"host": prefill.host, "port": prefill.port},
    }
    frames: list[tuple[Frame, dict[str, Any]]] = []
    with socket.create_connection((decode.host, decode.port), timeout=60) as sock:
        client_auth(sock, decode.token)
        send_json(sock, Frame.GENERATE, wire)
        while not frames or frames[-1][0] != Frame.DONE:
            header, payload = recv_frame(sock)
            assert header.type in (Frame.TOKEN, Frame.DONE), bytes(payload)
            frames.append((header.type, decode_json(header, payload)))
    tokens = [TokenEvent.from_json(body) for kind, body in frames if kind == Frame.TOKEN]
    done = Done.from_json(frames[-1][1])
    # Typed and back: the same JSON the agent sent.
    assert [t.to_json() for t in tokens] == [b for k, b in frames if k == Frame.TOKEN]
    assert done.to_json() == frames[-1][1]
    assert done.metrics.extra == {}  # every metric the agent sends is a declared field
    assert [t.id for t in tokens if t.id is not None] == done.token_ids and len(done.token_ids) == 6
    assert "".join(t.text for t in tokens) == done.text
    assert done.metrics.method == "disaggregated" and done.finish_reason == "length"
    assert done.prompt_ids and done.metrics.prompt_tokens == len(done.prompt_ids)
    # The wire client reads the same answer into the one client-side type.
    events: list[TokenEvent] = []
    result = wireclient.generate(
        decode.host, decode.port, wire, token=decode.token, on_token=events.append
    )
    assert (result.text, result.token_ids, result.prompt_ids) == (
        done.text,
        done.token_ids,
        done.prompt_ids,
    )
    # The same events; the first carries that request's own prompt-side timings.
    assert [replace(e, metrics=None) for e in events] == [replace(t, metrics=None) for t in tokens]
    first = events[0].metrics
    assert first is not None and first.prompt_tokens == done.metrics.prompt_tokens
    assert first.timeline is not None and set(first.timeline.as_json()) == {"at", "first_token"}
    assert all(e.metrics is None for e in events[1:]) and result.finish_reason == "length"
    assert result.metrics.agent_ttft is not None and result.metrics.total_time is not None


# ---- one response_format normalizer -------------------------------------------------------

normalize = GenerateRequest.normalize_format
STRICT = {"type": "json_schema", "schema": SCHEMA, "strict": True}
LOOSE = {"type": "json_schema", "schema": SCHEMA, "strict": False}
JSON = {"type": "json_object"}
LARK = {"type": "lark", "grammar": 'start: "a"'}


@pytest.mark.parametrize(
    "door, raw, expected",
    [
        ("ollama", "", None),
        ("ollama", "json", JSON),
        ("ollama", SCHEMA, STRICT),  # Ollama's grammar enforces a format: strict
        ("openai", {"type": "text"}, None),
        ("openai", {"type": "json_object"}, JSON),
        ("openai", {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}, LOOSE),
        (
            "openai",
            {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA, "strict": True}},
            STRICT,
        ),
        ("wire", STRICT, STRICT),
        ("wire", LOOSE, LOOSE),
        ("wire", None, None),
        ("responses", {"type": "grammar", "syntax": "lark", "definition": 'start: "a"'}, LARK),
        ("wire", LARK, LARK),
    ],
)
def test_each_front_doors_shape_normalizes_to_one(door: str, raw: Any, expected: Any) -> None:
    assert normalize(raw) == expected
    assert normalize(expected) == expected  # the normalized form is a fixed point
    req = GenerateRequest.from_dict({"prompt": "x", "response_format": raw})
    assert req.response_format == expected


@pytest.mark.parametrize(
    "raw, words",
    [
        (7, "must be"),
        ("yaml", "must be"),
        ({"type": "json_schema", "json_schema": {"name": "v"}}, "needs a schema"),
        ({"type": "xml"}, "use text, json_object, json_schema or grammar"),
    ],
)
def test_shapes_no_front_door_sends_are_refused(raw: Any, words: str) -> None:
    with pytest.raises(RequestError, match=words) as err:
        normalize(raw)
    assert err.value.field == "response_format"


def test_the_cli_format_flag_goes_through_the_normalizer(tmp_path: Path) -> None:
    from disagg.cli.commands import _response_format

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert _response_format("json") == JSON
    assert _response_format(str(schema_file)) == STRICT  # a bare schema, as Ollama's
    schema_file.write_text("[1, 2]")
    with pytest.raises(UsageError, match="--format"):
        _response_format(str(schema_file))
    with pytest.raises(UsageError, match="JSON Schema file"):
        _response_format(str(tmp_path / "missing.json"))


def test_no_other_module_builds_the_normalized_form() -> None:
    """Only the normalizer writes {"type": "json_schema", "schema": ..., "strict": ...}."""
    found = set()
    for root in ("disagg_agents", "disagg"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Dict):
                    keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                    if {"type", "schema", "strict"} <= keys:
                        found.add(path.relative_to(REPO).as_posix())
    assert found == {"disagg_agents/wire/request.py"}


# The top-level names each role's /status has always sent, in their order.
DECODE_STATUS_KEYS = ["role", "name", "model", "loaded", "backend", "device", "blas"]
DECODE_STATUS_KEYS += ["blas_threads", "blas_limited_by", "fingerprint", "context", "queued"]
DECODE_STATUS_KEYS += ["max_batch", "batch", "batch_waiting", "uptime_s", "requests", "in_flight"]
DECODE_STATUS_KEYS += ["prefix_cache", "prefix_disk", "grammars", "chat"]
PREFILL_STATUS_KEYS = ["role", "name", "model", "loaded", "backend", "device", "fingerprint"]
PREFILL_STATUS_KEYS += ["moe_paths", "uptime_s", "in_flight", "prefix_cache", "queue", "kv_send"]


def served_status(report: StatusReport) -> dict[str, Any]:
    """`report` as a control port with a cluster token serves it, read back as JSON."""
    token = b"s" * 32
    server = start_control("127.0.0.1", 0, lambda: report, str, token, threading.Event())
    try:
        raw = control_get("127.0.0.1", server.server_address[1], "/status", token)
    finally:
        server.shutdown()
        server.server_close()
    assert raw == json.dumps(report.as_json()).encode()  # turned into JSON there, once
    doc: dict[str, Any] = json.loads(raw)
    return doc


def test_each_roles_status_is_typed_and_served_as_the_document_it_was() -> None:
    stats = Stats("decode").snapshot()
    batch = {"batch": 2, "batch_waiting": 1, "batch_peak": 3, "decode_steps": 40}
    decode = DecodeStatus(
        name="d",
        model="/m",
        device="Device(cpu, 0)",
        blas="bundled",
        blas_threads=None,
        blas_limited_by=None,
        fingerprint={"dtype": "bfloat16"},
        context=2048,
        queued=batch["batch_waiting"],
        max_batch=8,
        batch=batch,
        stats=stats,
        prefix_cache={"hit_rate": 0.5},
        prefix_disk=None,
        grammars={"cached": 0},
        chat={"capabilities": ["completion"]},
    )
    doc = served_status(decode)
    assert [k for k in doc if k in DECODE_STATUS_KEYS] == DECODE_STATUS_KEYS
    assert set(doc) == {*DECODE_STATUS_KEYS, *batch, *stats}  # counters and batch: flat
    st = AgentStatus.from_json(doc)
    assert (st.backend, st.queued, st.batch, st.max_batch, st.context) == ("mlx", 1, 2, 8, 2048)
    assert st.in_flight == 0 and st.chat is not None
    assert st.chat.capabilities == ("completion",) and not st.mistyped
    path = MoePath(1, "grouped", "triton", "kept on the host")
    prefill = PrefillStatus(
        "p", "/m", "cuda", {}, (path,), Stats("prefill").snapshot(), {}, {"waiting": 0}, {}
    )
    doc = served_status(prefill)
    assert [k for k in doc if k in PREFILL_STATUS_KEYS] == PREFILL_STATUS_KEYS
    st = AgentStatus.from_json(doc)
    assert (st.backend, st.device, st.moe_paths, doc["loaded"]) == ("torch", "cuda", (path,), True)

"""Deadlines and admission, with real agents as processes: a request fails for a
decode agent's silence, not for its length (PROGRESS frames while it prefills or
queues); the gateway runs requests on a pool sized to the cluster, answers 429 /
503 with Retry-After past its admission limit, and bridges streams so a client
that hangs up mid-stream leaves no error behind."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from disagg.errors import RequestTimeout
from disagg.frontends.workers import QUEUE_FACTOR, Workers, batch_capacity
from disagg.serving.control import parse_status
from disagg.serving.localagents import AgentProc
from disagg.serving.router import Route, Router
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import recv_frame, send_json
from disagg_agents.wire.frames import Frame, decode_json
from disagg_agents.wire.request import GenerateRequest
from tests.agenthelpers import endpoint, in_flight
from tests.conftest import PairFactory
from tests.gateways import Gateway, GatewaySpec
from tests.slowprefill import SLOW_LAYER_S, SLOW_SET
from tests.tinymodels import PROMPT, shared_tiny

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0  # the pipelines' decode (idle) timeout in these tests
LAYER_DELAY_S = SLOW_LAYER_S  # between the prefill agent's 4 layers: >= 2.4 s, > TIMEOUT_S
CONSUMER_DELAY_S = 0.002  # per token: 3000 tokens stream for >= 6 s on any machine
LONG = GenerateRequest(prompt=PROMPT, raw=True, max_tokens=3000, ignore_eos=True, placement="local")


@pytest.fixture(scope="module")
def cluster(agent_pair: PairFactory) -> tuple[AgentProc, list[AgentProc]]:
    """A slow prefill agent and two decode agents of one batch slot each."""
    agents = agent_pair.set(shared_tiny("gpt_oss"), **SLOW_SET)
    return agents.prefill, agents.decodes[:2]


def router(prefill: AgentProc, decodes: list[AgentProc]) -> Router:
    route = Route(
        "tiny",
        [endpoint(prefill)],
        [endpoint(d) for d in decodes],
        prefill_timeout_s=60,
        decode_timeout_s=TIMEOUT_S,
    )
    return Router([route], token=prefill.token)


def slow_reader(times: list[float]) -> Callable[[TokenEvent], None]:
    """A token callback that notes each token's arrival and reads slowly."""

    def on_token(tok: TokenEvent) -> None:
        if tok.id is not None:
            times.append(time.monotonic())
        time.sleep(CONSUMER_DELAY_S)

    return on_token


def frames(decode: AgentProc, wire: dict[str, Any]) -> list[tuple[Frame, dict[str, Any]]]:
    """One GENERATE on a raw connection: every frame up to DONE, JSON ones decoded."""
    with socket.create_connection((decode.host, decode.port), timeout=60) as sock:
        client_auth(sock, decode.token)
        send_json(sock, Frame.GENERATE, wire)
        got: list[tuple[Frame, dict[str, Any]]] = []
        while not got or got[-1][0] != Frame.DONE:
            header, payload = recv_frame(sock)
            assert header.type != Frame.ERROR, bytes(payload)
            got.append((header.type, decode_json(header, payload)))
        return got


def test_progress_frames_while_prefilling_only_when_asked(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    prefill, (decode, _) = cluster
    target = {"host": prefill.host, "port": prefill.port}
    wire = {"prompt": PROMPT, "raw": True, "max_tokens": 4, "placement": "remote"}
    wire["prefill"] = target
    asked = frames(decode, {**wire, "progress_s": 0.25})
    kinds = [k for k, _ in asked]
    first_token = kinds.index(Frame.TOKEN)
    before = [body for k, body in asked[:first_token] if k == Frame.PROGRESS]
    # >= 2.4 s of prefill at one frame per 0.25 s: several, each saying what it waits for.
    assert len(before) >= 3 and all(b == {"phase": "prefill"} for b in before)
    assert kinds[-1] == Frame.DONE
    # A client that did not ask (an older one) never sees the frame type.
    plain = frames(decode, wire)
    assert Frame.PROGRESS not in [k for k, _ in plain]
    assert [b["id"] for k, b in plain if k == Frame.TOKEN] == [
        b["id"] for k, b in asked if k == Frame.TOKEN
    ]


def test_a_prefill_longer_than_the_timeout_is_no_failure(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    prefill, decodes = cluster
    r = router(prefill, decodes[:1])
    res = r.run("tiny", LONG.replace(max_tokens=8, placement="remote"))
    assert res.metrics.method == "disaggregated"  # waited for the slow prefill agent
    assert res.metrics.ttft is not None and res.metrics.ttft > TIMEOUT_S
    assert not res.metrics.rerouted_from and not r.down_until


def test_a_stream_longer_than_the_timeout_completes_and_one_queued_behind_it_too(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    """One batch slot: a stream read slowly for longer than the timeout completes, and a
    short request sent once it streams waits for its end, longer than the timeout; neither
    is a failure. (The queued request need not be long: only its wait is the claim.)"""
    prefill, decodes = cluster
    r = router(prefill, decodes[:1])
    times: list[float] = []
    streamed = LONG.replace(max_tokens=1350)  # read for >= 2.7 s on any machine, past TIMEOUT_S
    queued = LONG.replace(max_tokens=4)
    got: dict[str, Any] = {}
    stream = threading.Thread(
        target=lambda: got.update(streamed=r.run("tiny", streamed, on_token=slow_reader(times)))
    )
    stream.start()
    deadline = time.monotonic() + 120
    while not times:  # the stream holds the one slot from its first token to its last
        assert time.monotonic() < deadline and stream.is_alive(), "the stream never began"
        time.sleep(0.005)
    got["queued"] = r.run("tiny", queued)
    stream.join(300)
    res = got["streamed"]
    assert len(res.token_ids) == streamed.max_tokens == len(times)
    assert times[-1] - times[0] > TIMEOUT_S, "the stream: tokens came for less than the timeout"
    assert not res.metrics.rerouted_from, "the stream was rerouted"
    waited = got["queued"]
    assert len(waited.token_ids) == queued.max_tokens
    # The slot is the decode agent's: it frees when the stream's last token is decoded
    # (not read), so the wait is the stream's decode less its first token (~4.7 s here,
    # 3.5 ms a token), as the second of two 1,200-token streams waited ~4.2 s.
    assert waited.metrics.queue_time > TIMEOUT_S, "the queued request: waited less than the timeout"
    assert not waited.metrics.rerouted_from, "the queued request was rerouted"
    assert not r.down_until  # nobody was marked down


def test_a_silent_agent_is_failed_over_within_the_timeout(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    prefill, decodes = cluster
    r = router(prefill, decodes)
    # 600 tokens: ~2 s of decode on this box (3.5 ms a token), the signal lands within the
    # first ~0.2 s of it; the rerouted run resumes from the tokens already sent.
    req = LONG.replace(max_tokens=600)
    undisturbed = r.run("tiny", req)
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=r.run("tiny", req)))
    worker.start()
    deadline = time.monotonic() + 60
    while not any(in_flight(d) for d in decodes):
        assert time.monotonic() < deadline, "no decode agent took the request"
        time.sleep(0.02)
    victim = next(d for d in decodes if in_flight(d))
    stopped_at = time.monotonic()
    os.kill(victim.proc.pid, signal.SIGSTOP)  # alive, connected, and silent
    try:
        while victim.name not in r.down_until:  # the bound is read back below
            assert time.monotonic() - stopped_at < TIMEOUT_S + 120, "never"  # hang guard
            time.sleep(0.02)
        worker.join(120)
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    res = box["r"]
    assert res.token_ids == undisturbed.token_ids
    [why] = res.metrics.rerouted_from
    assert why.startswith(victim.name) and f"sent nothing for {TIMEOUT_S:g}s" in why


def test_a_total_deadline_only_where_the_caller_sets_one(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    prefill, decodes = cluster
    r = router(prefill, decodes)
    t0 = time.monotonic()
    times: list[float] = []
    with pytest.raises(RequestTimeout, match="deadline of 1s"):
        r.run("tiny", LONG, on_token=slow_reader(times), deadline_s=1.0)
    # Ended by the caller's deadline: not before it, and before the stream's end (3000
    # tokens at >= 2 ms each outlast it on any machine): an ordering, not a speed.
    assert time.monotonic() - t0 >= 1.0
    assert len(times) < LONG.max_tokens, len(times)
    assert not r.down_until  # the agent was working: it is not marked down


def test_the_worker_pool_is_the_clusters_batch_capacity(
    cluster: tuple[AgentProc, list[AgentProc]],
) -> None:
    prefill, decodes = cluster
    r = router(prefill, decodes)
    assert batch_capacity(r) == sum(d.status()["max_batch"] for d in decodes) == 2
    pool = Workers.for_router(r)
    assert (pool.size, pool.limit) == (2, QUEUE_FACTOR * 2)
    configured = Workers.for_router(r, 5, 7)
    assert (configured.size, configured.limit) == (5, 7)
    pool.shutdown()
    configured.shutdown()


# -- the gateway ----------------------------------------------------------------

STORY: Any = [{"role": "user", "content": "Write a very long story about the sea."}]


# As `disagg serve --local --workers 1 --max-requests 1`.
GATEWAY = GatewaySpec(workers=1, max_requests=1)


def base(gw: Gateway) -> str:
    return gw.url


def decode_control(gw: Gateway, path: str) -> dict[str, Any]:
    """The gateway's decode agent's /status or /health, over its control port with
    the cluster token."""
    return parse_status(gw.decode().control(path))


def decode_status(gw: Gateway) -> dict[str, Any]:
    return decode_control(gw, "/status")


def wait(cond: Callable[[], bool], what: str, limit_s: float = 120) -> None:
    """Until cond() holds; the limit is a hang guard, not a speed bar."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_full_gateway_answers_429_and_503_with_retry_after_then_recovers(
    gateway: Gateway,
) -> None:
    oai = openai.OpenAI(base_url=base(gateway) + "/v1", api_key="unused", max_retries=0)
    model = oai.models.list().data[0].id
    stream = oai.chat.completions.create(
        model=model, messages=STORY, max_tokens=4000, temperature=0, stream=True
    )
    body = {"model": model, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}
    try:
        # The first text: the stream holds the one worker while it decodes on.
        next(c for c in stream if c.choices and c.choices[0].delta.content)
        with pytest.raises(openai.RateLimitError) as refused:
            oai.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "1"
        error = refused.value.response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "limit of 1 requests" in error["message"]
        full = httpx.post(base(gateway) + "/api/generate", json=body, timeout=60)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert "limit of 1 requests" in full.json()["error"]
    finally:
        stream.close()  # hang up mid-stream: the worker stops at the next token
    # The official client retries a 429 after its Retry-After: the slot is free again.
    again = oai.with_options(max_retries=5).completions.create(
        model=model, prompt="Hi", max_tokens=2, temperature=0
    )
    assert again.usage is not None and again.usage.completion_tokens >= 1
    answer = httpx.post(base(gateway) + "/api/generate", json=body, timeout=120)
    assert answer.status_code == 200 and answer.json()["done"] is True


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": STORY, "max_tokens": 4000, "stream": True}),
        ("/api/chat", {"messages": STORY, "options": {"num_predict": 4000}}),
    ],
)
def test_a_client_leaving_mid_stream_leaves_no_error(
    gateway: Gateway, path: str, body: dict[str, Any]
) -> None:
    logged = gateway.log_mark()
    model = httpx.get(base(gateway) + "/v1/models", timeout=30).json()["data"][0]["id"]
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", base(gateway) + path, json={"model": model, **body}) as response,
    ):
        assert response.status_code == 200
        pieces = (line for line in response.iter_lines() if line.strip())
        got = [next(pieces) for _ in range(4)]  # a few pieces of text, then hang up
        assert all("content" in line for line in got)
    wait(lambda: decode_status(gateway)["in_flight"] == 0, "the decode agent to stop")
    log = gateway.log(since=logged)
    assert "generator already executing" not in log and "Traceback" not in log
    assert decode_control(gateway, "/health")["ok"] is True  # the agent stays healthy
    oai = openai.OpenAI(base_url=base(gateway) + "/v1", api_key="unused", max_retries=5)
    again = oai.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
    assert again.choices and again.usage is not None

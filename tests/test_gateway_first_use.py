"""What a new user meets first on `disagg serve` (its app in this process over real
agents; a killed agent's restart is in test_lifeline.py): `curl -d` without a content
type, stop-ended and cancelled requests that keep their metrics, one outcome
vocabulary in the APIs, Prometheus and the web view's data."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from typing import Any

import httpx
import pytest

from tests.agentpool import AgentSet
from tests.gateways import Gateway, GatewaySpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


# `disagg serve`'s app in this process, this module's own (its metrics, web view
# rows and log are its requests'), over the pooled SmolLM2 agents.
GATEWAY = GatewaySpec(own=True)


@pytest.fixture(scope="module")
def base(gateway: Gateway) -> str:
    return gateway.url


def curl(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST with `curl -d` as the README does: no content-type header of our own."""
    out = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", url, "-d", json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    text, _, code = out.rpartition("\n")
    return int(code), json.loads(text)


def test_curl_d_without_a_content_type_is_read_as_json(base: str) -> None:
    model = "SmolLM2-135M-Instruct"
    short = {"model": model, "stream": False, "options": {"num_predict": 2}}
    for path, body in (
        ("/api/generate", {**short, "prompt": QUESTION}),
        ("/api/chat", {**short, "messages": [{"role": "user", "content": QUESTION}]}),
        ("/api/show", {"model": model}),
        (
            "/v1/chat/completions",
            {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ):
        code, answer = curl(base + path, body)
        assert code == 200, (path, answer)
    code, answer = curl(base + "/api/generate", {"model": model, "keep_alive": 0})
    assert code == 200 and answer["done_reason"] == "unload", answer  # as Ollama


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return str(r.read().decode())


def _outcomes(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in _get(base + "/metrics").splitlines():
        if line.startswith("disagg_gateway_requests_total{"):
            key, value = line.rsplit(" ", 1)
            outcome = key.split('outcome="')[1].split('"')[0]
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def test_a_stop_ended_request_keeps_its_metrics_in_both_apis(base: str) -> None:
    before = _outcomes(base)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": QUESTION,
        "stream": False,
        "options": {"temperature": 0, "stop": ["France"], "num_predict": 40},
    }
    r = httpx.post(base + "/api/generate", json=body, timeout=300).json()
    assert r["done_reason"] == "stop" and "France" not in r["response"], r
    assert r["prompt_eval_count"] > 0 and r["eval_count"] > 0, r
    assert r["eval_duration"] > 0 and r["prompt_eval_duration"] > 0, r
    chat = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "stop": ["France"],
        "max_tokens": 40,
        "placement": "remote",
    }
    o = httpx.post(base + "/v1/chat/completions", json=chat, timeout=300).json()
    assert o["choices"][0]["finish_reason"] == "stop", o
    assert o["usage"]["prompt_tokens"] > 0 and o["usage"]["completion_tokens"] > 0, o
    m = o["disagg_metrics"]
    assert m["ttft"] is not None and m["method"] == "disaggregated", m
    assert "route" not in m and m.get("decode_server") is None, m  # no internals asked
    after = _outcomes(base)
    assert after.get("stop", 0) - before.get("stop", 0) == 2, (before, after)
    assert after.get("error", 0) == before.get("error", 0)


def test_a_cancelled_stream_is_cancelled_everywhere(base: str, smol_set: AgentSet) -> None:
    before = _outcomes(base)
    # The decode agents' own counters too (deltas: the pooled agents are shared).
    agent_before = sum(int(d.status()["cancelled"]) for d in smol_set.decodes)
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Tell me a long story about a lighthouse keeper.",
        "options": {"num_predict": 2000, "temperature": 0.8, "seed": 1},
    }
    with httpx.stream("POST", base + "/api/generate", json=body, timeout=300) as r:
        lines = r.iter_lines()
        for _ in range(4):  # a few tokens, then hang up
            assert json.loads(next(lines))["done"] is False
    deadline = time.monotonic() + 120
    while _outcomes(base).get("cancelled", 0) <= before.get("cancelled", 0):
        assert time.monotonic() < deadline, "the cancelled stream was never counted"
        time.sleep(0.5)
    assert _outcomes(base).get("error", 0) == before.get("error", 0)
    rows = json.loads(_get(base + "/ui/api/state"))["requests"]
    cancelled = [r for r in rows if r["outcome"] == "cancelled"]
    assert cancelled, rows
    row = cancelled[0]
    assert row["tokens"] >= 4 and row["ttft"] is not None and row["prompt_tokens"], row
    assert row["timeline"] and row["timeline"]["done"] > row["timeline"]["first_token"], row
    # At the decode agent: counted cancelled, and no longer decoding its 2000 tokens.
    deadline = time.monotonic() + 120
    while True:
        states = [d.status() for d in smol_set.decodes]
        if sum(int(s["cancelled"]) for s in states) > agent_before and not any(
            s["in_flight"] for s in states
        ):
            break
        assert time.monotonic() < deadline, ("the decode agent never stopped", states)
        time.sleep(0.2)


def _ask(base: str) -> dict[str, Any]:
    chat = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 4,
        "placement": "remote",  # the K/V on the wire, whatever placement learned
    }
    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_requests_are_logged_without_their_prompt(gateway: Gateway) -> None:
    mark = gateway.log_mark()
    _ask(gateway.url)
    deadline = time.monotonic() + 30
    while " request " not in gateway.log(mark):
        assert time.monotonic() < deadline, gateway.log(mark)
        time.sleep(0.2)
    lines = [ln for ln in gateway.log(mark).splitlines() if " request " in ln]
    assert lines and "capital" not in gateway.log(mark), lines
    assert "SmolLM2-135M-Instruct length disaggregated" in lines[-1], lines

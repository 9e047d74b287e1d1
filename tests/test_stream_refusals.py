"""A streamed request that cannot be served is a 4xx before any stream opens, on
every API, in that API's shape and with the reason whole: a prompt over the
context, a tool whose parameters are no schema, a response_format that is none.
Clients treat a 200 followed by a failure event as a network fault and retry
(Codex reconnects five times); a 4xx they show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from disagg.frontends.openai.types import OpenAIError
from disagg.frontends.responses.routes import _code
from tests.agentpool import AgentSet
from tests.gateways import Gateways

LONG = "word " * 12_000  # past SmolLM2's 8k context
BOGUS_TOOL: Any = {"type": "function", "name": "f", "parameters": {"type": "bogus"}}
BAD_SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}


def test_a_clients_mistake_after_the_start_is_no_server_error() -> None:
    assert _code(OpenAIError(400, "too long", "invalid_request_error")) == "invalid_prompt"
    assert _code(OpenAIError(503, "agent down", "server_error")) == "server_error"
    assert _code(OpenAIError(429, "busy", "requests", code="rate_limit_exceeded")) == (
        "rate_limit_exceeded"
    )


@pytest.fixture(scope="module")
def served(smol_set: AgentSet, gateways: Gateways, default_model: Path) -> tuple[str, str]:
    return gateways.get({default_model.name: smol_set}).url, default_model.name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "words"),
    [
        ({"input": LONG}, ["tokens", "context is 8192"]),
        ({"input": "hi", "tools": [BOGUS_TOOL]}, ["tools", "bogus"]),
        (
            {
                "input": "hi",
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}
                },
            },
            ["bogus"],
        ),
    ],
    ids=["over-the-context", "bogus-tool", "bad-text-format"],
)
def test_responses_stream_refused_with_a_4xx(
    served: tuple[str, str], case: dict[str, Any], words: list[str]
) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, stream=True, **case)
    assert all(w in str(e.value) for w in words), e.value


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        {"messages": [{"role": "user", "content": LONG}]},
        {"messages": [{"role": "user", "content": "hi"}], "response_format": BAD_SCHEMA},
    ],
    ids=["over-the-context", "bad-response-format"],
)
def test_chat_completions_stream_refused_with_a_4xx(
    served: tuple[str, str], case: dict[str, Any]
) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, stream=True, **case)


@pytest.mark.slow
def test_messages_stream_refused_with_the_context_named(served: tuple[str, str]) -> None:
    url, model = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=model,
            max_tokens=16,
            stream=True,
            messages=[{"role": "user", "content": LONG}],
        )
    assert e.value.body["type"] == "error"  # type: ignore[index]
    assert "context is 8192" in str(e.value), e.value


@pytest.mark.slow
def test_ollama_chat_stream_refused_with_a_4xx(served: tuple[str, str]) -> None:
    url, model = served
    r = httpx.post(
        url + "/api/chat",
        json={"model": model, "messages": [{"role": "user", "content": LONG}], "stream": True},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert "context is 8192" in r.json()["error"], r.text


@pytest.mark.slow
def test_a_servable_stream_still_streams(served: tuple[str, str]) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    events = list(
        client.responses.create(model=model, input="Hi", stream=True, max_output_tokens=8)
    )
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )

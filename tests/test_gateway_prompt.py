"""The default model (SmolLM2: a chat template without tool markup) through a new
gateway (`disagg serve`'s app) and real agents: a forced call comes back as a call on both APIs'
terms, and /api/show is right from the gateway's first request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.agentpool import AgentPool, AgentSet
from tests.gateways import client_over, start_gateway

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
FORCE: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def base(smol_set: AgentSet, agent_pool: AgentPool) -> Iterator[str]:
    """A gateway of this module's own (`disagg serve`'s app in this process, over the
    pooled SmolLM2 agents): its first request is this module's."""
    gateway = start_gateway(client_over({MODEL: smol_set}, agent_pool.token))
    try:
        yield gateway.url
    finally:
        gateway.stop()


def test_show_is_right_on_the_first_request(base: str) -> None:
    """continue.dev reads /api/show once, first: it must not be a cached failure."""
    r = httpx.post(f"{base}/api/show", json={"model": MODEL}, timeout=60)
    r.raise_for_status()
    shown = r.json()
    assert "<|im_start|>" in shown["template"]  # the model's own chat template
    # no tool markup (tools in the generic format), no think tags
    assert shown["capabilities"] == ["completion", "tools"]
    assert shown["model_info"]["disagg.tool_format"] == "generic"


def test_openai_forced_call_is_a_tool_call(base: str) -> None:
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=FORCE, max_tokens=80, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls: Any = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
    assert not choice.message.content
    # Streamed: the call in tool_calls deltas, no content.
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    names, args, content, finish = "", "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            names += (tc.function.name if tc.function else None) or ""
            args += (tc.function.arguments if tc.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (finish, names, content) == ("tool_calls", "get_weather", "")
    assert "city" in json.loads(args)


def test_ollama_tools_on_a_template_without_tool_markup(base: str) -> None:
    """Ollama itself refuses tools here ("does not support tools"); the generic format
    (tools in the system prompt, the answer a grammar-held JSON call or reply) serves them."""
    oc = ollama.Client(host=base, timeout=300)
    r = oc.chat(model=MODEL, messages=ASK, tools=[WEATHER], options={"seed": 0})
    if r.message.tool_calls:
        call = r.message.tool_calls[0].function
        assert call.name == "get_weather" and isinstance(call.arguments["city"], str), call
    else:
        assert (r.message.content or "").strip() and r.done_reason == "stop", r
    # The arguments as JSON by their schema, as before.
    params = WEATHER["function"]["parameters"]
    r = oc.chat(model=MODEL, messages=ASK, format=params, options={"num_predict": 60, "seed": 0})
    assert isinstance(json.loads(r.message.content or "")["city"], str)

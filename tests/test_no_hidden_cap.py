"""No hidden cap on an answer's length: a request without a limit runs until the
model stops or its context is full (as OpenAI's and Ollama's servers do); an
operator's `serve --max-tokens` default applies only where the client set none."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from disagg.frontends import maxtokens
from disagg.frontends.ollama.routes import chat_request as ollama_chat
from disagg.frontends.ollama.types import ChatBody
from disagg.frontends.openai.types import ChatRequest, chat_request
from disagg.frontends.responses.types import ResponsesRequest, generate_request
from tests.conftest import PairFactory
from tests.gateways import Gateways
from tests.tinymodels import shared_tiny

HI: Any = [{"role": "user", "content": "Hi"}]
# A schema whose one answer is longer than 256 tokens: the grammar then ends it, so
# the model stops by itself past where the old default cut it. 130 one-digit numbers:
# each digit a token of its own and each separator at least one more (SmolLM2's
# tokenizer never joins a digit to punctuation), so at least 260 tokens whatever the
# model picks, and a few hundred at most.
LONG_ANSWER: Any = {
    "type": "object",
    "properties": {
        "digits": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 130,
            "maxItems": 130,
        }
    },
    "required": ["digits"],
}


@pytest.fixture
def operator_default() -> Iterator[None]:
    yield
    maxtokens.set_default(None)


def test_without_a_limit_the_request_runs_to_the_context(operator_default: None) -> None:
    assert chat_request(ChatRequest(model="m", messages=HI)).max_tokens == maxtokens.UNLIMITED
    req, _ = generate_request(ResponsesRequest(model="m", input="Hi"))
    assert req.max_tokens == maxtokens.UNLIMITED
    assert ollama_chat(ChatBody(model="m", messages=HI)).max_tokens == maxtokens.UNLIMITED  # type: ignore[union-attr]


def test_the_operators_default_applies_only_without_a_client_limit(operator_default: None) -> None:
    maxtokens.set_default(100)
    assert chat_request(ChatRequest(model="m", messages=HI)).max_tokens == 100
    assert chat_request(ChatRequest(model="m", messages=HI, max_tokens=7)).max_tokens == 7
    assert ollama_chat(ChatBody(model="m", messages=HI)).max_tokens == 100  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="max-tokens"):
        maxtokens.set_default(0)


@pytest.mark.slow
def test_an_answer_past_256_tokens_is_not_cut(agent_pair: PairFactory, gateways: Gateways) -> None:
    """On the tiny qwen3 (a real chat template; a byte-level BPE of 512 tokens, whose
    random model spells the 130 items in ~800 tokens, seen): seconds, where SmolLM2's
    ~400 tokens took ~40 s; the gateway's path is the same."""
    model = "tiny-qwen3"
    url = gateways.get({model: agent_pair.set(shared_tiny("qwen3"))}).url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "List 130 digits."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "digits", "schema": LONG_ANSWER},
        },
    )
    assert r.usage is not None and r.usage.completion_tokens > 256, r.usage
    assert len(json.loads(r.choices[0].message.content or "")["digits"]) == 130
    assert r.choices[0].finish_reason == "stop"  # it ended itself, not on a limit

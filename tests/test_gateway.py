"""The gateway (`disagg serve`'s app, in this process) over the default model's
pooled agents, two decode agents behind it, driven by the official openai client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateways import Gateway, GatewaySpec
from tests.references import hf_greedy, tokenizer_ids

pytestmark = pytest.mark.slow

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


GATEWAY = GatewaySpec(n_decode=2)  # as `disagg serve --local --decode-agents 2`


@pytest.fixture(scope="module")
def oai(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(oai: openai.OpenAI) -> str:
    models = [m.id for m in oai.models.list().data]
    assert models == ["SmolLM2-135M-Instruct"]
    return models[0]


def test_chat_completion_answers_paris(oai: openai.OpenAI, model_id: str) -> None:
    r = oai.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_text_completion_and_length_finish(oai: openai.OpenAI, model_id: str) -> None:
    r = oai.completions.create(
        model=model_id, prompt="The capital of France is", temperature=0, max_tokens=3
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert r.choices[0].text


STORY: Any = [{"role": "user", "content": "Write a very long story about the sea."}]


def _clients_gone(gateway: Gateway) -> int:
    """How often the gateway's decode agents saw their client leave mid-request."""
    logs = [gateway.decode(i=i).log_path for i in range(2)]
    return sum(p.read_text(errors="replace").count("client went away") for p in logs)


def test_stream_first_chunk_arrives_while_decoding_goes_on(
    oai: openai.OpenAI, model_id: str, gateway: Gateway
) -> None:
    """Streaming is real: the first text reaches the client while the decode agent is
    still producing tokens. Read one chunk, hang up: the agent then sees its client gone
    mid-request, which a gateway that buffered the whole answer could not make happen."""
    before = _clients_gone(gateway)
    stream = oai.chat.completions.create(
        model=model_id, temperature=0, max_tokens=4000, stream=True, messages=STORY
    )
    first = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            assert chunk.choices[0].finish_reason is None  # not the last chunk
            first = chunk.choices[0].delta.content
            break
    stream.close()
    assert first
    deadline = time.monotonic() + 120  # a hang guard, not a speed bar
    while _clients_gone(gateway) == before:
        assert time.monotonic() < deadline, "no decode agent saw the client leave"
        time.sleep(0.2)


def test_stream_carries_every_token_and_the_usage(
    oai: openai.OpenAI, model_id: str, refs: Any, default_model: Path
) -> None:
    story = "Tell me a short story about a cat."
    pieces: list[str] = []
    finish = usage = None
    stream = oai.chat.completions.create(
        model=model_id,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": story}],
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert finish == "length" and usage is not None and usage.completion_tokens == 24
    assert len(pieces) >= 10  # text in pieces as it was made, not one block
    # Every token: the pieces are transformers' own greedy continuation of the prompt
    # its tokenizer's chat template makes, nothing dropped, doubled or reordered.
    from transformers import AutoTokenizer

    ids = tokenizer_ids(default_model, story)
    ref = hf_greedy(refs.hf(default_model), ids, 24)
    tok = AutoTokenizer.from_pretrained(str(default_model))
    assert usage.prompt_tokens == len(ids)
    assert "".join(pieces) == tok.decode(ref, skip_special_tokens=True), pieces


def test_same_text_streamed_or_not(oai: openai.OpenAI, model_id: str) -> None:
    whole = (
        oai.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=12)
        .choices[0]
        .message.content
    )
    parts = [
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(
            model=model_id, messages=QUESTION, temperature=0, max_tokens=12, stream=True
        )
        if c.choices
    ]
    assert "".join(parts) == whole


def test_unknown_model_is_a_404_in_openai_shape(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="no-such-model", messages=QUESTION)
    body = info.value.body
    assert isinstance(body, dict)
    err = body.get("error", body)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "no-such-model" in err["message"]


@pytest.mark.parametrize(
    "bad, param",
    [
        ({"temperature": 7}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"top_p": 0}, "top_p"),
    ],
)
def test_invalid_parameters_are_400s(
    oai: openai.OpenAI, model_id: str, bad: dict[str, object], param: str
) -> None:
    args: dict[str, object] = {"model": model_id, "messages": QUESTION, **bad}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**args)  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict)
    err = body.get("error", body)
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "")


def test_prompt_over_the_context_is_a_400(oai: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError, match="context is 8192"):
        oai.completions.create(model=model_id, prompt="word " * 9000, max_tokens=2)


def test_sixteen_concurrent_clients_all_get_paris(oai: openai.OpenAI, model_id: str) -> None:
    def ask(i: int) -> str:
        r = oai.chat.completions.create(
            model=model_id, messages=QUESTION, temperature=0, max_tokens=12
        )
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert len(answers) == 16
    assert all(a == answers[0] for a in answers) and "Paris" in answers[0]


def test_json_object_from_a_real_model(oai: openai.OpenAI, model_id: str) -> None:
    # Any JSON object (no schema): a real model closes it; the constraint keeps it JSON.
    r = oai.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)

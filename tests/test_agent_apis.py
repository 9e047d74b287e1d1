"""The APIs agent CLIs speak, through `disagg serve`'s app and the official SDKs:
Anthropic's Messages API (Claude Code) and OpenAI's Responses API (Codex), on tiny
random-weight models whose tokenizers speak harmony and Qwen3-Coder's format, and on
SmolLM2. With random weights the text is noise: what is checked is the shape, and
what a constraint makes valid by construction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import ResponseFunctionCallArgumentsDoneEvent, ResponseTextDeltaEvent

from tests.agentpool import AgentSet
from tests.conftest import PairFactory
from tests.gateways import Gateways
from tests.tinymodels import shared_tiny

pytestmark = pytest.mark.slow

HARMONY, CODER = "tiny-harmony", "tiny-qwen3-coder"
KEY = "agent-apis-test-key-0123456789"
WEATHER_IN: Any = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
SYSTEM = (
    "You are a coding agent working in a repository. Read files before you change them, "
    "run the tests after each change, and keep your answers short and to the point."
)


@pytest.fixture(scope="module")
def serve(
    agent_pair: PairFactory, smol_set: AgentSet, gateways: Gateways, default_model: Path
) -> tuple[str, str]:
    """The gateway's URL and SmolLM2's model name: `disagg serve`'s app in this
    process over the pooled agents of the three models, keyed."""
    sets = {
        default_model.name: smol_set,
        HARMONY: agent_pair.set(shared_tiny("gpt_oss")),
        CODER: agent_pair.set(shared_tiny("qwen3_coder")),
    }
    return gateways.get(sets, api_keys=[KEY]).url, default_model.name


@pytest.fixture(scope="module")
def claude(serve: tuple[str, str]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=serve[0], api_key=KEY, max_retries=0, timeout=300)


def ended(out_tokens: int, cap: int, capped: str, natural: str) -> str:
    """The status an answer of `out_tokens` under a cap of `cap` must report."""
    return capped if out_tokens >= cap else natural


@pytest.fixture(scope="module")
def oai(serve: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve[0]}/v1", api_key=KEY, max_retries=0, timeout=300)


# ---- Anthropic's Messages API -------------------------------------------------------------


def test_messages_plain_and_streamed(claude: anthropic.Anthropic, serve: tuple[str, str]) -> None:
    smol = serve[1]
    ask: Any = [{"role": "user", "content": "What is the capital of France?"}]
    r = claude.messages.create(
        model=smol, max_tokens=12, messages=ask, extra_body={"temperature": 0}
    )
    assert r.type == "message" and r.role == "assistant"
    assert r.stop_reason == ended(r.usage.output_tokens, 12, "max_tokens", "end_turn"), r
    assert r.content[0].type == "text" and "Paris" in r.content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    with claude.messages.stream(
        model=smol, max_tokens=12, messages=ask, extra_body={"temperature": 0}
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert "message_delta" in kinds
    assert final.content[0].type == "text" and final.content[0].text == r.content[0].text
    assert final.stop_reason == r.stop_reason
    # stop_sequences end the answer there, and say which one did.
    stopped = claude.messages.create(
        model=smol,
        max_tokens=12,
        messages=ask,
        extra_body={"temperature": 0},
        stop_sequences=["Paris"],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in stopped.content[0].text  # type: ignore[union-attr]


def test_messages_forced_tool_use_and_its_result(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_IN}]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for model in (HARMONY, CODER):
        r = claude.messages.create(
            model=model,
            max_tokens=200,
            messages=ask,
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        assert r.stop_reason == "tool_use", r
        use = next(b for b in r.content if b.type == "tool_use")
        assert use.name == "get_weather" and isinstance(use.input, dict)
        assert isinstance(use.input["city"], str)
        turn: Any = [
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}],
            },
        ]
        again = claude.messages.create(model=model, max_tokens=16, messages=turn, tools=tools)
        # The stop reason the answer itself implies: a call, the cap reached, or its end.
        if any(b.type == "tool_use" for b in again.content):
            assert again.stop_reason == "tool_use", again
        else:
            n = again.usage.output_tokens
            assert again.stop_reason == ended(n, 16, "max_tokens", "end_turn"), again
        # Streamed, the tool_use arrives whole as input_json_delta.
        with claude.messages.stream(
            model=model,
            max_tokens=200,
            messages=ask,
            tools=tools,
            tool_choice={"type": "any"},
        ) as s:
            events = list(s)
            final = s.get_final_message()
        assert final.stop_reason == "tool_use"
        use = next(b for b in final.content if b.type == "tool_use")
        assert use.name == "get_weather"
        partial = [
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        assert partial and json.loads("".join(partial)) == use.input, (partial, use.input)


def test_messages_thinking_blocks_from_harmony(claude: anthropic.Anthropic) -> None:
    # Random weights choose whether to reason; greedy, this prompt under a JSON format does.
    ask: Any = [{"role": "user", "content": "Plan a trip."}]
    fmt: Any = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    kw: Any = {
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "output_config": fmt,
        "extra_body": {"temperature": 0},
    }
    r = claude.messages.create(model=HARMONY, max_tokens=100, messages=ask, **kw)
    assert [b.type for b in r.content] == ["thinking", "text"], r.content
    assert r.content[0].thinking and "<|" not in r.content[0].thinking
    with claude.messages.stream(model=HARMONY, max_tokens=100, messages=ask, **kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in kinds  # the SDK's thinking delta event
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == r.content[0].thinking  # type: ignore[union-attr]
    # The thinking goes back in the history as Claude Code sends it.
    turn: Any = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": "And at sunset?"},
    ]
    assert claude.messages.create(model=HARMONY, max_tokens=8, messages=turn).content


def test_messages_system_blocks_without_the_billing_nonce_share_the_cache(
    claude: anthropic.Anthropic, serve: tuple[str, str]
) -> None:
    def ask(nonce: str) -> anthropic.types.Message:
        system: Any = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0; cch={nonce};"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ]
        messages: Any = [{"role": "user", "content": "List the files in the repository."}]
        return claude.messages.create(
            model=serve[1],
            max_tokens=4,
            system=system,
            messages=messages,
            extra_body={"temperature": 0},
        )

    first, second = ask("a1b2c"), ask("f9e8d")
    assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) > 32
    assert (second.usage.cache_read_input_tokens or 0) > 0, second.usage
    assert first.content[0].text == second.content[0].text  # type: ignore[union-attr]
    n = claude.messages.count_tokens(
        model=serve[1], system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    )
    assert n.input_tokens > 20


def test_messages_errors_in_anthropic_shape(
    claude: anthropic.Anthropic, serve: tuple[str, str]
) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        claude.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    image: Any = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    ]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model=serve[1], max_tokens=4, messages=[{"role": "user", "content": image}]
        )
    assert "image" in bad.value.message
    wrong = anthropic.Anthropic(base_url=serve[0], api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(
            model=serve[1], max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    r = httpx.post(f"{serve[0]}/v1/messages", json={"model": serve[1]}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    # The agents stay healthy.
    ok = claude.messages.create(
        model=serve[1], max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    assert ok.usage.output_tokens > 0


# ---- OpenAI's Responses API ---------------------------------------------------------------

WEATHER_FN: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER_IN,
    "strict": True,
}
# A small patch language, as Codex's apply_patch tool gives its grammar.
# Bounded (at most three lines of at most 20 characters): every model, at any
# temperature, reaches the end well inside max_output_tokens (an unbounded `add_line+`
# let SmolLM2 at temperature 1 add lines until the limit cut it).
PATCH_LARK = r"""
start: begin_patch hunk end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Add File: " filename LF add_line add_line? add_line?
filename: /[a-z]{1,8}\.py/
add_line: "+" /[a-z =()0-9]{0,20}/ LF
%import common.LF
"""
PATCH_TOOL: Any = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_LARK},
}
RESPONSE_MODELS = (HARMONY, CODER, "smol")


def _model(serve: tuple[str, str], name: str) -> str:
    return serve[1] if name == "smol" else name


@pytest.mark.parametrize("name", RESPONSE_MODELS)
def test_responses_plain_and_streamed(
    oai: openai.OpenAI, serve: tuple[str, str], name: str
) -> None:
    model = _model(serve, name)
    r = oai.responses.create(
        model=model,
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
    )
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.output and r.status == ended(r.usage.output_tokens, 12, "incomplete", "completed")
    assert "<|" not in r.output_text
    if name == "smol":
        assert "Paris" in r.output_text
    stream = oai.responses.create(
        model=model,
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
        stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{events[-1].response.status}"  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    final = events[-1].response  # type: ignore[union-attr]
    assert text == final.output_text
    if name != HARMONY:  # greedy: the same text streamed or not
        assert text == r.output_text
    # Same prompt again: its prefix comes from the cache.
    again = oai.responses.create(
        model=model,
        input="What is the capital of France?",
        max_output_tokens=2,
    )
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("name", RESPONSE_MODELS)
def test_responses_forced_function_call_and_its_output(
    oai: openai.OpenAI, serve: tuple[str, str], name: str
) -> None:
    model = _model(serve, name)
    ask: Any = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    r = oai.responses.create(
        model=model,
        input=ask,
        tools=[WEATHER_FN, {"type": "web_search"}],
        tool_choice={"type": "function", "name": "get_weather"},
        instructions="Use the tools.",
        max_output_tokens=200,
        include=["reasoning.encrypted_content"],
    )
    call = next(i for i in r.output if i.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    for rs in (i for i in r.output if i.type == "reasoning"):  # plain text, sent back as is
        assert rs.content and rs.encrypted_content == rs.content[0].text
    history: Any = [
        *ask,
        *[i.model_dump(exclude_none=True) for i in r.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    # SmolLM2's template takes no tools: only a forced call may name them.
    tools: Any = [WEATHER_FN] if name != "smol" else openai.NOT_GIVEN
    again = oai.responses.create(model=model, input=history, tools=tools, max_output_tokens=8)
    assert again.output and again.usage is not None
    assert again.status == ended(again.usage.output_tokens, 8, "incomplete", "completed")
    # Streamed: the arguments as function_call_arguments deltas, whole at .done and in
    # the final item.
    events = list(
        oai.responses.create(
            model=model,
            input=ask,
            tools=[WEATHER_FN],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200,
            stream=True,
        )
    )
    deltas: list[Any] = [e for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert isinstance(done, ResponseFunctionCallArgumentsDoneEvent)
    last: Any = events[-1]  # response.completed: the whole response
    streamed = next(i for i in last.response.output if i.type == "function_call")
    assert deltas and "".join(d.delta for d in deltas) == done.arguments == streamed.arguments
    assert {d.item_id for d in deltas} == {done.item_id} == {streamed.id}
    assert isinstance(json.loads(streamed.arguments)["city"], str)


@pytest.mark.parametrize("name", RESPONSE_MODELS)
def test_responses_custom_tool_with_a_lark_grammar(
    oai: openai.OpenAI, serve: tuple[str, str], name: str
) -> None:
    model = _model(serve, name)
    ask = "Add a file hello.py that prints hi."
    stream = oai.responses.create(
        model=model,
        input=ask,
        tools=[PATCH_TOOL, WEATHER_FN],
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=600,
        stream=True,
    )
    events = list(stream)
    assert events[-1].type == "response.completed", events[-1]
    output = events[-1].response.output
    call = next(i for i in output if i.type == "custom_tool_call")
    assert call.name == "apply_patch" and call.input.startswith("*** Begin Patch\n")
    # The input parses under the tool's grammar.
    assert _lark_accepts(PATCH_LARK, call.input), call.input
    # ... and goes back as a custom_tool_call with its output.
    history: Any = [
        {"role": "user", "content": ask},
        call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done"},
    ]
    tools: Any = [PATCH_TOOL] if name != "smol" else openai.NOT_GIVEN  # as above
    again = oai.responses.create(model=model, input=history, tools=tools, max_output_tokens=8)
    assert again.output


def _lark_accepts(lark: str, text: str) -> bool:
    """Whether `text` is a sentence of `lark`, checked byte by byte by llguidance."""
    import llguidance as llg

    tok = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))
    m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


class _Bytes:
    """256 one-byte tokens and an end token: every text has one spelling."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s.encode() if isinstance(s, str) else s)


@pytest.mark.parametrize("name", RESPONSE_MODELS)
def test_responses_strict_text_format(
    oai: openai.OpenAI, serve: tuple[str, str], name: str
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "grade": {"type": "string", "enum": ["pass", "fail"]},
            # Bounded: a tiny random model would otherwise write digits until
            # max_output_tokens cut the JSON short.
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["grade", "score"],
        "additionalProperties": False,
    }
    r = oai.responses.create(
        model=_model(serve, name),
        input="Grade: 2+2=5",
        max_output_tokens=300,
        text={
            "format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
        },
    )
    got = json.loads(r.output_text)
    assert got["grade"] in ("pass", "fail") and isinstance(got["score"], int)
    assert 0 <= got["score"] <= 10 and r.status == "completed"


def test_responses_bad_input_is_one_clear_400(oai: openai.OpenAI, serve: tuple[str, str]) -> None:
    smol = serve[1]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": [{"type": "teleport", "to": "mars"}]}, "teleport"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "stateless"),
        (
            {
                "input": "hi",
                "tools": [
                    {**PATCH_TOOL, "format": {**PATCH_TOOL["format"], "definition": "start: ("}}
                ],
            },
            "does not compile",
        ),
        ({"input": "hi", "tools": [{"type": "computer_use_preview"}]}, "computer_use_preview"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image",
        ),
    ]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            oai.responses.create(model=smol, max_output_tokens=4, **extra)
        assert words in bad.value.message, bad.value.message
    ok = oai.responses.create(model=smol, input="hi", max_output_tokens=2)
    assert ok.usage is not None
    assert ok.status == ended(ok.usage.output_tokens, 2, "incomplete", "completed"), ok

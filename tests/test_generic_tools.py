"""Tools on a model whose chat template takes none (SmolLM2's): the generic format.
The tools are described in the system prompt; the grammar holds the answer to
one JSON call (arguments valid for the tool's schema) or response; the parser
streams a response's text and reads a call whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance as llg
import openai
import pytest

from disagg_agents.chatformat import detect, render_chat
from disagg_agents.chatformat.generic import GenericParser, json_string_prefix
from disagg_agents.chatformat.parse import ParsedCall, Piece
from disagg_agents.decode.grammarformats import generic_lark
from tests.agentpool import AgentSet
from tests.gateways import Gateways

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SHELL: Any = {
    "type": "function",
    "function": {
        "name": "shell",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
        },
    },
}


class _Bytes:
    """256 one-byte tokens and an end token: every text has one spelling."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s.encode() if isinstance(s, str) else s)


def accepts(lark: str, text: str) -> bool:
    tok = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))
    m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"response": "Hi \\"you\\"\\n"}', True),
        ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', True),
        ('{"tool_call": {"name": "shell", "arguments": {"command": ["ls", "-l"]}}}', True),
        ('{"tool_call": {"name": "get_weather", "arguments": {}}}', False),  # city required
        ('{"tool_call": {"name": "get_weather", "arguments": {"town": "X"}}}', False),
        ('{"tool_call": {"name": "rm_rf", "arguments": {}}}', False),  # no such tool
        ('{"response": 42}', False),
        ("Sure! Here you go.", False),
    ],
)
def test_the_grammar_holds_a_call_or_a_response(text: str, ok: bool) -> None:
    assert accepts(generic_lark([WEATHER, SHELL]), text) is ok


def feed(parser: GenericParser, text: str, step: int) -> list[Any]:
    events: list[Any] = []
    for i in range(0, len(text), step):
        events += parser.text(text[i : i + step])
    return events + parser.finish()


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_a_response_streams_as_content_whatever_the_token_split(step: int) -> None:
    said = 'Hi "there" é 😀\nok \\ done'
    text = json.dumps({"response": said})  # \ud83d\ude00 and escapes split anywhere
    events = feed(GenericParser(), text, step)
    assert all(isinstance(e, Piece) and e.channel == "content" for e in events)
    assert "".join(e.text for e in events) == said
    assert len(events) > 1 or step == 100  # streamed, not held to the end


def test_a_call_is_read_whole_and_an_unclosed_one_is_no_call() -> None:
    text = json.dumps({"tool_call": {"name": "shell", "arguments": {"command": ["ls"]}}})
    assert feed(GenericParser(), text, 3) == [
        ParsedCall("shell", {"command": ["ls"]}, '{"command": ["ls"]}')
    ]
    assert feed(GenericParser(), text[:-5], 3) == []
    assert feed(GenericParser(), "plain words", 3) == [Piece("content", "plain words")]


def test_json_string_prefix_waits_for_a_split_escape() -> None:
    assert json_string_prefix("ab\\") == ("ab", False)
    assert json_string_prefix("ab\\u00") == ("ab", False)
    assert json_string_prefix('ab\\u00e9"}') == ("abé", True)


def test_smollm2_gets_the_tools_in_its_system_prompt_and_history_as_json(
    default_model: Path,
) -> None:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model)
    fmt = detect(tok)
    assert not fmt.tools  # the premise: SmolLM2's template takes no tools
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    text = tok.decode(render_chat(tok, fmt, history, system="Be brief.", tools=[WEATHER]))
    system = text.split("<|im_end|>")[0]
    assert "Be brief." in system and '"name": "get_weather"' in system
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in text
    assert '{"tool_response": {"name": "get_weather", "content": "Sunny"}}' in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def oai(smol_set: AgentSet, gateways: Gateways, default_model: Path) -> tuple[openai.OpenAI, str]:
    url = gateways.get({default_model.name: smol_set}).url
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), default_model.name


@pytest.mark.slow
@pytest.mark.parametrize(
    "ask", ["What is the weather in Paris? Use the tool.", "Say hello to me in one sentence."]
)
def test_smollm2_answers_or_calls_a_tool_through_chat_completions(
    oai: tuple[openai.OpenAI, str], ask: str
) -> None:
    client, model = oai
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ask}],
        tools=[WEATHER, SHELL],
        temperature=0,
        max_tokens=200,
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        call: Any = choice.message.tool_calls[0]
        assert choice.finish_reason == "tool_calls"
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "shell")
        assert isinstance(args.get("city") or args.get("command"), str | list), args
    else:
        assert choice.finish_reason == "stop", choice
        text = choice.message.content or ""
        assert text.strip() and "response" not in text[:12], text  # the words, not the JSON


@pytest.mark.slow
def test_smollm2_streams_a_responses_turn_with_tools(oai: tuple[openai.OpenAI, str]) -> None:
    client, model = oai
    tools: Any = [{"type": "function", "name": "shell", **SHELL["function"]}]
    events: list[Any] = list(
        client.responses.create(
            model=model,
            input="Say hello.",
            instructions="You are a coding agent.",
            tools=tools,
            stream=True,
        )
    )
    assert events[-1].type == "response.completed", events[-1]
    kinds = {i.type for i in events[-1].response.output}
    assert kinds & {"message", "function_call"}, kinds

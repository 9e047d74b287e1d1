"""Calls the model did not finish, recovered as the best parsers recover them,
and never markup in the answer's text.

Qwen3-Coder drops closing tags on long calls (vLLM and Ollama recover them); a
value that does not convert to its schema's type stays the string written;
gpt-oss and Qwen calls cut by max_tokens are no calls and no content. Each
output is fed token by token through the real tokenizer and the streaming
detokenizer, and as text split at every position."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from disagg_agents.chatformat import detect, open_stream, render_chat
from disagg_agents.chatformat.parse import Event, ParsedCall, TagParser, parse_qwen_xml
from disagg_agents.chatformat.qwenxml import convert
from tests.chattokenizers import build

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
            },
            "required": ["city"],
        },
    },
}
LEAKS = ("<function=", "<parameter=", "<tool_call>", "</tool_call>", "<|", "</function>")
PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}
F, P = "<function=get_weather>\n", "<parameter=city>\nParis\n"

# output -> (content, calls) once the model has stopped (EOS)
CASES: dict[str, tuple[str, tuple[str, list[dict[str, Any]]]]] = {
    "whole": (f"<tool_call>\n{F}{P}</parameter>\n</function>\n</tool_call>", ("", [PARIS])),
    "no </function>": (f"<tool_call>\n{F}{P}</parameter>\n</tool_call>", ("", [PARIS])),
    "no </parameter>": (f"<tool_call>\n{F}{P}</function>\n</tool_call>", ("", [PARIS])),
    "no closes at all": (f"<tool_call>\n{F}{P}", ("", [PARIS])),
    "no <tool_call> after prose": (
        f"Let me check.\n{F}{P}</parameter>\n</function>\n</tool_call>",
        ("Let me check.", [PARIS]),
    ),
    "bare and unclosed": (f"Checking.\n{F}{P}", ("Checking.", [PARIS])),
    "bare, then prose": (
        f"Checking.\n{F}{P}</parameter>\n</function>\nDone.",
        ("Checking.Done.", [PARIS]),
    ),
    "value that does not convert": (
        f"<tool_call>\n{F}{P}</parameter>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=metric>\nyes\n</parameter>\n<parameter=hours>\n[1, 2\n</parameter>\n"
        "</function>\n</tool_call>",
        (
            "",
            [
                {
                    "name": "get_weather",
                    "arguments": {
                        "city": "Paris",
                        "days": "three",
                        "metric": "yes",
                        "hours": "[1, 2",
                    },
                }
            ],
        ),
    ),
    "second parameter without close": (
        f"<tool_call>\n{F}{P}</parameter>\n<parameter=days>\n3\n</function>\n</tool_call>",
        ("", [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]),
    ),
    "two calls, the first unclosed": (
        f"<tool_call>\n{F}{P}</parameter>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
        "</tool_call>",
        ("", [PARIS, {"name": "get_weather", "arguments": {"city": "Rome"}}]),
    ),
    "close tag inside a value": (
        f"<tool_call>\n{F}<parameter=city>\nA</tool_call>B\n</parameter>\n</function>\n</tool_call>",
        ("", [{"name": "get_weather", "arguments": {"city": "A</tool_call>B"}}]),
    ),
}


def splits(text: str) -> list[list[str]]:
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


def reading(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    content = "".join(e.text for e in events if not isinstance(e, ParsedCall))
    return content, [e.to_dict() for e in events if isinstance(e, ParsedCall)]


@pytest.fixture(scope="module")
def coder() -> Any:
    return build("qwen3_coder")


@pytest.mark.parametrize("name", list(CASES))
def test_qwen3_coder_recovers_as_stated(name: str, coder: Any) -> None:
    output, want = CASES[name]
    fmt = detect(coder)
    prompt = render_chat(coder, fmt, [{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    stream = open_stream(
        fmt, coder, prompt, tools=[WEATHER], detokenizer=BPEStreamingDetokenizer(coder)
    )
    ids = coder.encode(output, add_special_tokens=False)
    events = [e for tid in ids for e in stream.add(tid)] + stream.finish()
    assert reading(events) == want
    for parts in splits(output):
        p = TagParser(think=False, tool_parser=parse_qwen_xml, tools=[WEATHER])
        got = reading([e for part in parts for e in p.text(part)] + p.finish())
        assert got == want, parts
        assert not any(leak in got[0] for leak in LEAKS)


@pytest.mark.parametrize("name", list(CASES))
def test_a_call_cut_by_max_tokens_is_no_content(name: str) -> None:
    """Cut anywhere, the answer's text holds no markup, and a call that was not
    whole is not reported."""
    output, (content, calls) = CASES[name]
    for end in range(len(output) + 1):
        p = TagParser(think=False, tool_parser=parse_qwen_xml, tools=[WEATHER])
        got = reading(p.text(output[:end]) + p.finish(cut=True))
        assert not any(leak in got[0] for leak in LEAKS), output[:end]
        assert content.startswith(got[0].rstrip())
        for call in got[1]:
            assert call["name"] == "get_weather"


def test_harmony_call_cut_by_max_tokens_is_dropped() -> None:
    """`{"city":"Paris","unit":"` was shown as content: a cut call is no answer."""
    tok = build("harmony")
    fmt = detect(tok)
    prompt = render_chat(tok, fmt, [{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    head = (
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","unit":"'
    )
    ids = tok.encode(head, add_special_tokens=False)
    for cut in (True, False):
        stream = open_stream(
            fmt, tok, prompt, tools=[WEATHER], detokenizer=BPEStreamingDetokenizer(tok)
        )
        for tid in ids:
            stream.add(tid)
        stream.finish(cut=cut)
        got = stream.result()
        assert got["text"] == "" if cut else got["text"].startswith('{"city"')
        assert got["reasoning"] == "Call it." and "tool_calls" not in got


def test_plain_template_forced_call_is_the_call() -> None:
    """A template without tool markup: the grammar makes the answer the call's JSON."""
    from tests.tinymodels import _tokenizer

    tok = _tokenizer(512)
    tok.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    fmt = detect(tok)
    assert fmt.kind == "plain"
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for forced, want in ((True, {"text": "", "tool_calls": [PARIS]}), (False, {"text": body})):
        stream = open_stream(
            fmt, tok, [1], tools=[WEATHER], forced=forced, detokenizer=BPEStreamingDetokenizer(tok)
        )
        for tid in tok.encode(body, add_special_tokens=False):
            stream.add(tid)
        stream.finish()
        assert stream.result() == want


@pytest.mark.parametrize(
    ("value", "schema", "want"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),
        ("12345678901234567890123", {"type": "integer"}, 12345678901234567890123),
        ("2.5", {"type": "number"}, 2.5),
        ("1e999", {"type": "number"}, "1e999"),
        ("true", {"type": "boolean"}, True),
        ("maybe", {"type": "boolean"}, "maybe"),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("{'a': 1}", {"type": "object"}, {"a": 1}),
        ("{oops", {"type": "object"}, "{oops"),
        ("null", {"type": "string"}, None),
        ("7", {"type": ["integer", "null"]}, 7),
        ("x", None, "x"),
    ],
)
def test_values_convert_or_stay_strings(value: str, schema: Any, want: Any) -> None:
    assert convert(value, schema) == want

"""Chat formats from the tokenizer: detection, prompts, and the streaming parser
over the token sequences harmony, Qwen3 and Qwen3-Coder models emit.

The tokenizers carry the formats' real special tokens (tests/chattokenizers.py);
each answer is fed token by token through mlx-lm's streaming detokenizer, and
its text split at every position, and must come out the same."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from disagg_agents.chatformat import (
    ChatFormat,
    FormatError,
    detect,
    open_stream,
    render_chat,
    render_fim,
)
from disagg_agents.chatformat.parse import (
    Event,
    HarmonyParser,
    ParsedCall,
    Piece,
    TagParser,
    parse_qwen_json,
    parse_qwen_xml,
)
from disagg_agents.wire.request import GenerateRequest, RequestError
from tests.chattokenizers import build
from tests.tinymodels import _tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
MARKUP = ("<|", "|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=")


@pytest.fixture(scope="module")
def toks() -> dict[str, Any]:
    plain = _tokenizer(512)
    plain.chat_template = (
        "{% for m in messages %}<|endoftext|>{{ m.role }}\n{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
    )
    return {k: build(k) for k in ("harmony", "qwen3", "qwen3_coder")} | {"plain": plain}


def run_stream(tok: Any, fmt: ChatFormat, prompt: list[int], output: str, **kw: Any) -> dict:
    """The model's output as token ids, fed one at a time; the result DONE carries."""
    ids = tok.encode(output, add_special_tokens=False)
    stream = open_stream(fmt, tok, prompt, detokenizer=BPEStreamingDetokenizer(tok), **kw)
    for tid in ids:
        stream.add(tid)
    stream.finish()
    return stream.result()


def collect(events: list[Event]) -> dict[str, Any]:
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": []}
    for e in events:
        if isinstance(e, ParsedCall):
            out["calls"].append(e.to_dict())
        else:
            out[e.channel] += e.text
    return out


def splits(text: str) -> list[list[str]]:
    """The text whole, in two parts split at every position, and char by char."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


# -- detect --------------------------------------------------------------------


def test_detect_reads_vocab_and_template(toks: dict[str, Any]) -> None:
    h, q, c, p = (detect(toks[k]) for k in ("harmony", "qwen3", "qwen3_coder", "plain"))
    vocab = toks["harmony"].get_vocab()
    assert (h.kind, h.reasoning, h.tools, h.fim) == ("harmony", True, True, None)
    assert h.stop_ids == {vocab["<|return|>"], vocab["<|call|>"]}
    assert h.capabilities == ["completion", "tools", "thinking"]
    assert (q.kind, q.reasoning, q.fim) == ("qwen_json", True, None)
    assert q.capabilities == ["completion", "tools", "thinking"]
    cv = toks["qwen3_coder"].get_vocab()
    assert (c.kind, c.reasoning) == ("qwen_xml", False)
    assert c.fim == (cv["<|fim_prefix|>"], cv["<|fim_suffix|>"], cv["<|fim_middle|>"])
    assert c.capabilities == ["completion", "tools", "insert"]
    # No tool markup: tools go through the generic format (chatformat.generic).
    assert (p.kind, p.capabilities, p.tool_format) == ("plain", ["completion", "tools"], "generic")
    assert (h.tool_format, c.tool_format) == ("harmony", "template")
    assert c.template == toks["qwen3_coder"].chat_template


# -- harmony -------------------------------------------------------------------

H_THINK_ANSWER = (
    "<|channel|>analysis<|message|>The user asks about Paris. Let me think.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>"
)
H_TOOL = (
    "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}<|call|>'
)
H_TOOL_AFTER_ROLE = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Paris"}<|call|>'
)


def test_harmony_token_by_token(toks: dict[str, Any]) -> None:
    tok = toks["harmony"]
    fmt = detect(tok)
    prompt = render_chat(tok, fmt, [{"role": "user", "content": "Capital of France?"}])
    assert tok.decode(prompt).endswith("<|start|>assistant")
    ids = tok.encode(H_THINK_ANSWER, add_special_tokens=False)
    assert set(fmt.special_ids.values()) & set(ids), "the specials must be single tokens"
    got = run_stream(tok, fmt, prompt, H_THINK_ANSWER)
    assert got == {
        "text": "The capital of France is Paris.",
        "reasoning": "The user asks about Paris. Let me think.",
    }
    got = run_stream(tok, fmt, prompt, H_TOOL, tools=[WEATHER])
    assert got == {
        "text": "",
        "reasoning": "Need the weather: call get_weather.",
        "tool_calls": [
            {
                "name": "get_weather",
                "arguments": {"city": "Paris", "days": 2},
                "arguments_text": '{"city": "Paris", "days": 2}',
            }
        ],
    }


def harmony_items(text: str) -> list[tuple[str, str]]:
    """("special", name) and ("text", s) items of a harmony string."""
    import re

    return [
        ("special", part) if re.fullmatch(r"<\|\w+\|>", part) else ("text", part)
        for part in re.split(r"(<\|\w+\|>)", text)
        if part
    ]


@pytest.mark.parametrize("output", [H_THINK_ANSWER, H_TOOL, H_TOOL_AFTER_ROLE])
def test_harmony_split_everywhere(output: str) -> None:
    """Each text run split at every position gives the same result; header text
    and markup never reach content or reasoning."""
    items = harmony_items(output)
    expected = None
    for n, (kind, text) in enumerate(items):
        if kind != "text":
            continue
        for parts in splits(text):
            parser = HarmonyParser()
            parser.special("<|start|>")
            parser.text("assistant")
            events: list[Event] = []
            for k, (kind2, text2) in enumerate(items):
                feed = parts if k == n else [text2]
                for piece in feed:
                    events += parser.special(text2) if kind2 == "special" else parser.text(piece)
            events += parser.finish()
            got = collect(events)
            expected = expected or got
            assert got == expected
            for m in MARKUP + ("analysis", "final", "commentary", "to=functions"):
                assert m not in got["content"] and m not in got["reasoning"]
    assert expected is not None
    if output == H_TOOL_AFTER_ROLE:
        assert expected["calls"] == [
            {
                "name": "get_weather",
                "arguments": {"city": "Paris"},
                "arguments_text": '{"city": "Paris"}',
            }
        ]


def test_harmony_commentary_preamble_is_content_and_bad_args_are_text() -> None:
    p = HarmonyParser()
    ev: list[Event] = []
    for kind, text in harmony_items(
        "<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{not json<|call|>"
    ):
        ev += p.special(text) if kind == "special" else p.text(text)
    got = collect(ev + p.finish())
    assert got == {"content": "Checking now.{not json", "reasoning": "", "calls": []}


def test_harmony_prompt_effort_and_dropped_analysis(toks: dict[str, Any]) -> None:
    tok = toks["harmony"]
    fmt = detect(tok)
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "thinking": "SECRET-REASONING"},
        {"role": "user", "content": "Again"},
    ]
    text = tok.decode(render_chat(tok, fmt, msgs, think="high"))
    assert "Reasoning: high" in text
    assert "SECRET-REASONING" not in text  # earlier turns' analysis is dropped
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert "Reasoning: low" in tok.decode(render_chat(tok, fmt, msgs, think=False))


def test_harmony_round_trip_and_parallel_calls(toks: dict[str, Any]) -> None:
    """The parsed call, sent back with its result, renders as harmony has it:
    arguments as the model wrote them (OpenAI clients send back the string we
    returned), an object (Ollama) as compact JSON; the result as its text."""
    tok = toks["harmony"]
    fmt = detect(tok)
    user = {"role": "user", "content": "Weather in Paris?"}
    first = render_chat(tok, fmt, [user], tools=[WEATHER])
    got = run_stream(tok, fmt, first, H_TOOL, tools=[WEATHER])
    call = got["tool_calls"][0]
    assert call["arguments_text"] == '{"city": "Paris", "days": 2}'
    for args, written in (
        (call["arguments_text"], '{"city": "Paris", "days": 2}'),
        (call["arguments"], '{"city":"Paris","days":2}'),
    ):
        msgs = [
            user,
            {
                "role": "assistant",
                "content": None,
                "thinking": got["reasoning"],
                "tool_calls": [{"id": "c1", "function": {"name": call["name"], "arguments": args}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
        ]
        text = tok.decode(render_chat(tok, fmt, msgs, tools=[WEATHER]))
        assert text.endswith(
            "<|start|>assistant<|channel|>analysis<|message|>Need the weather: call get_weather."
            "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
            f"<|constrain|>json<|message|>{written}<|call|>"
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            '{"sky": "sunny"}<|end|><|start|>assistant'
        )
    # Two calls in one turn: one call per message, each followed by its own result.
    two: list[dict[str, Any]] = [
        user,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "noon"},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    text = tok.decode(render_chat(tok, fmt, two, tools=[WEATHER]))
    a = text.index(
        'to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city"'
    )
    sunny = text.index(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny"
    )
    b = text.index("to=functions.get_time<|channel|>")
    noon = text.index(
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>noon"
    )
    assert a < sunny < b < noon


# -- Qwen3 -------------------------------------------------------------------

Q_THINK = "<think>\nThe user asks about Paris.\n</think>\n\nThe capital of France is Paris."
Q_CALLS = (
    "<think>\nI need the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'
)
C_CALL = (
    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_token_by_token(toks: dict[str, Any]) -> None:
    tok = toks["qwen3"]
    fmt = detect(tok)
    prompt = render_chat(tok, fmt, [{"role": "user", "content": "Capital?"}], tools=[WEATHER])
    assert run_stream(tok, fmt, prompt, Q_THINK) == {
        "text": "The capital of France is Paris.",
        "reasoning": "The user asks about Paris.",
    }
    assert run_stream(tok, fmt, prompt, Q_CALLS, tools=[WEATHER]) == {
        "text": "",
        "reasoning": "I need the weather.",
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_weather", "arguments": {"city": "Rome", "days": 3}},
        ],
    }
    # Without tools in the request, a <tool_call> is just text.
    got = run_stream(tok, fmt, prompt, Q_CALLS)
    assert "tool_calls" not in got and got["text"].startswith("<tool_call>")


def test_qwen3_coder_token_by_token(toks: dict[str, Any]) -> None:
    tok = toks["qwen3_coder"]
    fmt = detect(tok)
    prompt = render_chat(tok, fmt, [{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    assert run_stream(tok, fmt, prompt, C_CALL, tools=[WEATHER]) == {
        "text": "I will look it up.",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}],
    }
    # No <think> in its template: a <think> it writes is content, not reasoning.
    assert run_stream(tok, fmt, prompt, "<think>x</think>")["text"] == "<think>x</think>"


@pytest.mark.parametrize(
    ("output", "tool_parser", "first"),
    [
        (Q_THINK, None, False),
        (Q_CALLS, parse_qwen_json, False),
        (C_CALL, parse_qwen_xml, False),
        ("The user asks.\n</think>\n\nParis.", None, True),  # the prompt opened <think>
    ],
)
def test_tags_split_everywhere(output: str, tool_parser: Any, first: bool) -> None:
    """Tags split over several pieces are held back: the same result for every
    split, and reasoning never shows in content."""
    results = []
    for parts in splits(output):
        p = TagParser(think=True, tool_parser=tool_parser, tools=[WEATHER], reasoning_first=first)
        events: list[Event] = []
        for part in parts:
            events += p.text(part)
        results.append(collect(events + p.finish()))
    assert all(r == results[0] for r in results)
    got = results[0]
    for m in MARKUP:
        assert m not in got["content"] and m not in got["reasoning"]
    if got["reasoning"]:
        assert got["reasoning"] not in got["content"]
    if first:
        assert got == {"content": "Paris.", "reasoning": "The user asks.", "calls": []}


@pytest.mark.parametrize("first", [False, True])
def test_a_think_tag_inside_the_answer_is_the_answers_text(first: bool) -> None:
    """Seen in a structured answer: a random model wrote "<think>" inside a JSON
    string, and the rest of its JSON went to reasoning. Under an output grammar only
    a think block before the answer is reasoning; free text still hides the tags."""
    answer = '{"reason": "a <think> b</think> c"}'
    head = "Why.</think>" if first else "<think>Why.</think>"
    for structured in (True, False):
        for parts in splits(head + answer):
            p = TagParser(think=True, reasoning_first=first, structured=structured)
            events: list[Event] = []
            for part in parts:
                events += p.text(part)
            got = collect(events + p.finish())
            if structured:
                assert got == {"content": answer, "reasoning": "Why.", "calls": []}
            else:
                assert "<think>" not in got["content"] and "</think>" not in got["content"]


def test_a_close_tag_inside_a_json_argument_is_the_arguments_text(toks: dict[str, Any]) -> None:
    """Seen under tool_choice "required" (~1 request in 40 of a random Qwen3): the
    grammar let the token "</tool_call>" into the city string, the call was cut
    there, and its JSON came back as content. A close tag inside a JSON string is
    the string's text; one in a string that never closes was a close after all."""
    city = 'a "</tool_call>" \\"</tool_call>x'
    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    output = f"<think>Hm.</think><tool_call>\n{call}\n</tool_call>"
    want = {"content": "", "reasoning": "Hm.", "calls": [json.loads(call)]}
    broken = '<tool_call>{"name": "x</tool_call>After.'
    for text, expected in ((output, want), (broken, None)):
        for parts in splits(text):
            p = TagParser(think=True, tool_parser=parse_qwen_json, tools=[WEATHER])
            events: list[Event] = []
            for part in parts:
                events += p.text(part)
            got = collect(events + p.finish())
            if expected is not None:
                assert got == expected
            else:
                assert got == {"content": '{"name": "x' + "After.", "reasoning": "", "calls": []}
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA</tool_call>B\n</parameter>\n"
    for parts in splits(xml + "</function>\n</tool_call>"):
        p = TagParser(think=True, tool_parser=parse_qwen_xml, tools=[WEATHER])
        got = collect([e for part in parts for e in p.text(part)] + p.finish())
        assert got["calls"] == [{"name": "get_weather", "arguments": {"city": "A</tool_call>B"}}]
    # Token by token through the real tokenizer, where "</tool_call>" is one token.
    tok = toks["qwen3"]
    fmt = detect(tok)
    prompt = render_chat(tok, fmt, [{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    assert tok.convert_tokens_to_ids("</tool_call>") in tok.encode(call, add_special_tokens=False)
    assert run_stream(tok, fmt, prompt, output, tools=[WEATHER]) == {
        "text": "",
        "reasoning": "Hm.",
        "tool_calls": [json.loads(call)],
    }


def test_tags_stream_before_the_end() -> None:
    """Content streams as it comes; only what could start a tag waits."""
    p = TagParser(think=True, tool_parser=parse_qwen_json)
    assert p.text("Hello wor") == [Piece("content", "Hello wor")]
    assert p.text("ld <tool") == [Piece("content", "ld")]
    assert p.text("box") == [Piece("content", " <toolbox")]
    assert p.text(" <tool_call>{bad</tool_call>") == [Piece("content", "{bad")]


def test_qwen_round_trip(toks: dict[str, Any]) -> None:
    for kind, output, expected in (
        (
            "qwen3",
            Q_CALLS,
            "<|im_start|>assistant\n<think>\nI need the weather.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
            "\n<tool_response>\nrainy\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "qwen3_coder",
            C_CALL,
            "<|im_start|>assistant\nI will look it up.\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
    ):
        tok = toks[kind]
        fmt = detect(tok)
        user = {"role": "user", "content": "Weather?"}
        got = run_stream(
            tok, fmt, render_chat(tok, fmt, [user], tools=[WEATHER]), output, tools=[WEATHER]
        )
        calls = [
            {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for i, c in enumerate(got["tool_calls"])
        ]
        msgs = [
            user,
            {
                "role": "assistant",
                "content": got["text"],
                "reasoning_content": got.get("reasoning"),
                "tool_calls": calls,
            },
            *(
                {"role": "tool", "tool_call_id": c["id"], "content": r}
                for c, r in zip(calls, ("sunny", "rainy")[: len(calls)], strict=True)
            ),
        ]
        text = tok.decode(render_chat(tok, fmt, msgs, tools=[WEATHER]))
        assert text.endswith(expected), text


def test_think_settings(toks: dict[str, Any]) -> None:
    tok = toks["qwen3"]
    fmt = detect(tok)
    user = [{"role": "user", "content": "Hi"}]
    assert tok.decode(render_chat(tok, fmt, user, think=False)).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.decode(render_chat(tok, fmt, user, think=True)).endswith("<|im_start|>assistant\n")
    plain = toks["plain"]
    with pytest.raises(FormatError, match="think"):
        render_chat(plain, detect(plain), user, think=True)
    render_chat(plain, detect(plain), user, think=False)  # false is always fine
    # No tools in the template: the generic format puts them in the system prompt,
    # unless an output grammar already decides the answer.
    generic = plain.decode(render_chat(plain, detect(plain), user, tools=[WEATHER]))
    assert '"tool_call"' in generic and "get_weather" in generic
    with pytest.raises(FormatError, match="tools"):
        render_chat(plain, detect(plain), user, tools=[WEATHER], structured=True)
    # A call forced by constrained decoding needs no tools in the template.
    forced = render_chat(plain, detect(plain), user, tools=[WEATHER], forced=True)
    assert forced == render_chat(plain, detect(plain), user)


# -- fill-in-the-middle ----------------------------------------------------------


def test_fim_prompt_and_refusal(toks: dict[str, Any]) -> None:
    tok = toks["qwen3_coder"]
    ids = render_fim(tok, detect(tok), "def add(a, b):\n    return ", "\n\nprint(add(2, 3))")
    v = tok.get_vocab()
    enc = tok.encode
    assert ids == [
        v["<|fim_prefix|>"],
        *enc("def add(a, b):\n    return ", add_special_tokens=False),
        v["<|fim_suffix|>"],
        *enc("\n\nprint(add(2, 3))", add_special_tokens=False),
        v["<|fim_middle|>"],
    ]
    assert detect(tok).fim_stop_ids >= {v["<|fim_pad|>"], v["<|file_sep|>"]}
    for kind in ("harmony", "plain"):
        with pytest.raises(FormatError, match="suffix.*fill-in-the-middle"):
            render_fim(toks[kind], detect(toks[kind]), "a", "b")


# -- the request's fields ---------------------------------------------------------


def test_request_chat_fields() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert GenerateRequest.from_dict(base).to_wire() == {**base, "max_tokens": 256}
    r = GenerateRequest.from_dict(
        {
            **base,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "think": "high",
        }
    )
    assert GenerateRequest.from_dict(r.to_wire()) == r
    fim = GenerateRequest.from_dict({"prompt": "", "suffix": "tail"})
    assert fim.to_wire() == {"prompt": "", "suffix": "tail", "max_tokens": 256}
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "thinking": "t",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
    ]
    GenerateRequest.from_dict({"messages": history, "tools": [WEATHER]})
    bad: list[tuple[dict[str, Any], str, str]] = [
        (
            {
                **base,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [WEATHER],
            },
            "tool_choice",
            "'nope', which is not in tools",
        ),
        ({**base, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({**base, "tool_choice": "sometimes"}, "tool_choice", "one of auto, none, required"),
        (
            {**base, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools",
            "name must be",
        ),
        ({**base, "tools": [{"type": "retrieval"}]}, "tools", "tools\\[0\\] must be"),
        ({**base, "think": "max"}, "think", "low, medium, high"),
        ({**base, "suffix": "x"}, "suffix", "not messages"),
        ({"prompt": "a", "suffix": 3}, "suffix", "must be text"),
        (
            {"messages": [{"role": "assistant", "content": None}]},
            "messages",
            "content must be text",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "messages",
            "JSON object",
        ),
    ]
    for d, field, message in bad:
        with pytest.raises(RequestError, match=message) as e:
            GenerateRequest.from_dict(d)
        assert e.value.field == field


def test_an_emoji_cut_by_max_tokens_leaves_no_replacement_char(toks: dict[str, Any]) -> None:
    tok = toks["qwen3"]
    ids = tok.encode("Hi 🙂", add_special_tokens=False)
    whole = tok.decode(ids)
    cut = next(n for n in range(len(ids), 0, -1) if "\ufffd" in tok.decode(ids[:n]))
    assert whole.endswith("🙂") and cut < len(ids)
    stream = open_stream(detect(tok), tok, [], chat=False, detokenizer=BPEStreamingDetokenizer(tok))
    for tid in ids[:cut]:  # max_tokens ends it inside the emoji's bytes
        stream.add(tid)
    stream.finish()
    assert stream.result()["text"] == "Hi ", stream.result()  # no "\ufffd" at the end

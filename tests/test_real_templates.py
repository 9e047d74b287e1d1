"""The chat templates Qwen3 and Qwen3-Coder ship, as references: what we render is
what transformers' own `apply_chat_template` renders with the real template, and the
tool calls the real template writes into an assistant turn (the text the model was
trained to emit) come back out of our streaming parser, and out of mlx-lm's own tool
parsers, as the calls that went in.

The templates are data beside the repo (../shared/fixtures/chat-templates, as the
models ship them); DISAGG_CHAT_TEMPLATES=DIR points elsewhere."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from disagg_agents.chatformat import detect, render_chat
from tests.chattokenizers import build
from tests.test_chatformat import WEATHER, run_stream

ROOT = Path(__file__).resolve().parent.parent
CANDIDATES: list[str | Path] = [
    os.environ.get("DISAGG_CHAT_TEMPLATES", ""),
    ROOT.parent / "shared/fixtures/chat-templates",
    ROOT.parent.parent / "shared/fixtures/chat-templates",
]
HERE = next((Path(c) for c in CANDIDATES if c and Path(c, "Qwen3-Coder.jinja").exists()), None)
pytestmark = pytest.mark.skipif(
    HERE is None, reason="the real chat templates: set DISAGG_CHAT_TEMPLATES=DIR"
)

TEMPLATES = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "qwen3_coder": "Qwen3-Coder.jinja"}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "top": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "search", "arguments": {"query": "Rome, in spring", "top": 2}},
]
ASK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and news of Rome?"},
]


def real(kind: str) -> Any:
    """The test tokenizer of that format (its real special tokens) with the template
    the model ships."""
    assert HERE is not None
    tok = build(kind)
    tok.chat_template = (HERE / TEMPLATES[kind]).read_text()
    return tok


def assistant_calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": c} for c in calls],
    }


CONVERSATIONS = {
    "one user turn": ASK,
    "a call, its results, a follow-up": [
        *ASK,
        assistant_calls(CALLS),
        {"role": "tool", "content": "Sunny, 21 C"},
        {"role": "tool", "content": "A festival."},
        {"role": "assistant", "content": "Sunny; a festival."},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ],
}


@pytest.mark.parametrize("kind", TEMPLATES)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_we_render_what_transformers_renders_with_the_real_template(kind: str, name: str) -> None:
    tok = real(kind)
    fmt = detect(tok)
    messages = CONVERSATIONS[name]
    ours = render_chat(tok, fmt, messages, tools=TOOLS)
    ref = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == tok.encode(ref, add_special_tokens=False), (tok.decode(ours), ref)


def test_thinking_off_renders_as_the_real_qwen3_template_says() -> None:
    tok = real("qwen3")
    fmt = detect(tok)
    ours = render_chat(tok, fmt, ASK, think=False)
    ref = tok.apply_chat_template(
        ASK, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert ours == tok.encode(ref, add_special_tokens=False), (tok.decode(ours), ref)
    assert tok.decode(ours).endswith("<think>\n\n</think>\n\n")  # the template's own way


def emitted(tok: Any, calls: list[dict[str, Any]], content: str = "") -> str:
    """The text the real template writes for an assistant turn with these calls:
    what the model was trained to emit, up to its end-of-turn token."""
    turn = {**assistant_calls(calls), "content": content}
    whole = tok.apply_chat_template([*ASK, turn], tools=TOOLS, tokenize=False)
    prompt = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert whole.startswith(prompt)
    return str(whole[len(prompt) :]).rsplit("<|im_end|>", 1)[0]


@pytest.mark.parametrize("kind", TEMPLATES)
@pytest.mark.parametrize("n", [1, 2])
def test_the_calls_the_real_template_writes_parse_back(kind: str, n: int) -> None:
    tok = real(kind)
    fmt = detect(tok)
    prompt = render_chat(tok, fmt, ASK, tools=TOOLS)
    text = emitted(tok, CALLS[:n])
    got = run_stream(tok, fmt, prompt, text, tools=TOOLS)
    assert got.get("tool_calls") == CALLS[:n], (text, got)
    assert not got.get("text", "").strip(), got


@pytest.mark.parametrize("kind", TEMPLATES)
def test_mlx_lms_own_tool_parsers_agree(kind: str) -> None:
    """mlx-lm's parser for the format, on each <tool_call> body the real template
    wrote, gives the same calls ours does."""
    from mlx_lm.tool_parsers import json_tools, qwen3_coder

    parser = json_tools if kind == "qwen3" else qwen3_coder
    text = emitted(real(kind), CALLS)
    bodies = [part.split("</tool_call>", 1)[0] for part in text.split("<tool_call>")[1:]]
    assert len(bodies) == len(CALLS), text
    theirs = [parser.parse_tool_call(body, TOOLS) for body in bodies]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in theirs] == CALLS

"""Chat formats through real agents: a tiny random gpt_oss with a harmony
tokenizer never shows markup in its answer text, FIM prompts are built from the
tokenizer's FIM tokens (or refused with a reason), and bad chat fields are
refused while the agent stays healthy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from disagg.errors import UsageError
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.status import AgentStatus
from tests.chattokenizers import HARMONY_SPECIALS
from tests.conftest import PairFactory, ask
from tests.tinymodels import shared_tiny

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HEADER_WORDS = ("<|", "|>", "to=functions", "<|constrain|>")


def frames_of(
    decode: Any, req: dict[str, Any], prefill: Any = None
) -> tuple[Any, list[TokenEvent]]:
    frames: list[TokenEvent] = []
    result = ask(decode, req, prefill=prefill, on_token=frames.append)
    return result, frames


def test_harmony_markup_never_reaches_text(
    agent_pair: PairFactory, tiny_model: Callable[..., Path]
) -> None:
    prefill, decode = agent_pair("gpt_oss", config={"chat": "harmony"})
    tok = AutoTokenizer.from_pretrained(tiny_model("gpt_oss", 0, chat="harmony"))
    chat = decode.status()["chat"]
    assert chat["kind"] == "harmony" and chat["capabilities"] == ["completion", "tools", "thinking"]
    markup = {tok.convert_tokens_to_ids(t) for t in HARMONY_SPECIALS[1:]}
    enders = {tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")}
    seen_markup = 0
    for seed in range(8):
        req = {"messages": USER, "max_tokens": 48, "temperature": 1.0, "seed": seed}
        result, frames = frames_of(decode, req, prefill if seed % 2 else None)
        seen_markup += len(markup & set(result.token_ids))
        assert not enders & set(result.token_ids)  # they end the answer, unsent
        for text in (result.text, result.reasoning or ""):
            for word in HEADER_WORDS:
                assert word not in text, (seed, text)
        # The stream says what DONE says: content frames make text, reasoning apart.
        assert "".join(f.text for f in frames if not f.is_reasoning) == result.text
        assert "".join(f.text for f in frames if f.is_reasoning) == (result.reasoning or "")
        assert [f.id for f in frames if f.id is not None] == result.token_ids
    assert seen_markup, "the random model never wrote harmony markup: the test proved nothing"


def test_fim_prompt_from_the_tokenizer(
    agent_pair: PairFactory, tiny_model: Callable[..., Path]
) -> None:
    _, decode = agent_pair(shared_tiny("qwen3_coder"))
    tok = AutoTokenizer.from_pretrained(shared_tiny("qwen3_coder"))
    st = AgentStatus.from_json(decode.status())  # as /api/show reads it
    assert st.mistyped == () and st.chat is not None and st.chat.capabilities is not None
    assert "insert" in st.chat.capabilities and st.chat.fim_tokens is not None
    assert all(t in tok.get_vocab() for t in st.chat.fim_tokens), st.chat.fim_tokens
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))"
    result = ask(
        decode,
        {"prompt": prefix, "suffix": suffix, "max_tokens": 4, "return_prompt_ids": True},
    )
    enc = tok.encode
    assert result.prompt_ids == [
        tok.convert_tokens_to_ids("<|fim_prefix|>"),
        *enc(prefix, add_special_tokens=False),
        tok.convert_tokens_to_ids("<|fim_suffix|>"),
        *enc(suffix, add_special_tokens=False),
        tok.convert_tokens_to_ids("<|fim_middle|>"),
    ]


def test_refusals_name_the_field_and_the_agent_stays_healthy(agent_pair: PairFactory) -> None:
    _, decode = agent_pair(shared_tiny("llama"))  # no FIM tokens, no chat template
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with pytest.raises(UsageError, match="suffix: .*no fill-in-the-middle tokens"):
        ask(decode, {"prompt": "def f():", "suffix": "\n", "max_tokens": 2})
    with pytest.raises(UsageError, match="tool_choice names function 'nope'"):
        ask(
            decode,
            {
                "prompt": "hi",
                "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
        )
    assert (
        len(
            ask(
                decode, {"prompt": "hi", "raw": True, "max_tokens": 3, "ignore_eos": True}
            ).token_ids
        )
        == 3
    )

"""The APIs agent CLIs speak, through a real `disagg serve` and the official SDKs:
Anthropic's Messages API (Claude Code) and OpenAI's Responses API (Codex), on tiny
random-weight models whose tokenizers speak harmony and Qwen3-Coder's format, and on
SmolLM2. With random weights the text is noise: what is checked is the shape, and
what a constraint makes valid by construction."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import start_serve

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
    tiny_model: Callable[..., Path], default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """The gateway's URL and SmolLM2's model name."""
    root = tmp_path_factory.mktemp("agentapis-serve")
    args = ["-m", str(default_model)]
    for name, arch, chat in ((HARMONY, "gpt_oss", "harmony"), (CODER, "qwen3", "qwen3_coder")):
        args += ["-m", str(shutil.copytree(tiny_model(arch, 0, chat=chat), root / name))]
    env = {"DISAGG_API_KEY": KEY}
    proc, port = start_serve(*args, log_path=root / "serve.log", env=env)
    yield f"http://127.0.0.1:{port}", default_model.name
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def claude(serve: tuple[str, str]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=serve[0], api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(serve: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve[0]}/v1", api_key=KEY, max_retries=0, timeout=300)


# ---- Anthropic's Messages API -------------------------------------------------------------


def test_messages_plain_and_streamed(claude: anthropic.Anthropic, serve: tuple[str, str]) -> None:
    smol = serve[1]
    ask: Any = [{"role": "user", "content": "What is the capital of France?"}]
    r = claude.messages.create(
        model=smol, max_tokens=24, messages=ask, extra_body={"temperature": 0}
    )
    assert (
        r.type == "message"
        and r.role == "assistant"
        and r.stop_reason in ("end_turn", "max_tokens")
    )
    assert r.content[0].type == "text" and "Paris" in r.content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    with claude.messages.stream(
        model=smol, max_tokens=24, messages=ask, extra_body={"temperature": 0}
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
        max_tokens=24,
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
        assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
        # Streamed, the tool_use arrives whole as input_json_delta.
        with claude.messages.stream(
            model=model,
            max_tokens=200,
            messages=ask,
            tools=tools,
            tool_choice={"type": "any"},
        ) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use"
        assert any(b.type == "tool_use" and b.name == "get_weather" for b in final.content)


def test_messages_thinking_blocks_from_harmony(claude: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Why is the sky blue?"}]
    thinking: Any = {"type": "enabled", "budget_tokens": 2048}
    r = claude.messages.create(model=HARMONY, max_tokens=64, messages=ask, thinking=thinking)
    assert r.content[0].type == "thinking" and r.content[0].thinking
    assert "<|" not in r.content[0].thinking
    with claude.messages.stream(model=HARMONY, max_tokens=64, messages=ask, thinking=thinking) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking
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

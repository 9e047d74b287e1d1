"""The Messages and Responses bodies as the one request: pure mapping, no agents."""

from __future__ import annotations

import pytest

from disagg.frontends.anthropic.types import (
    AnthropicError,
    MessagesRequest,
    generate_request,
    system_text,
)
from disagg.frontends.openai.types import OpenAIError
from disagg.frontends.responses import types as rt

NONCE = "x-anthropic-billing-header: cc_version=2.1.0; cch=5f3a1;"


def test_the_billing_header_block_is_dropped() -> None:
    blocks = [{"type": "text", "text": NONCE}, {"type": "text", "text": "You are Claude Code."}]
    assert system_text(blocks) == "You are Claude Code."
    assert system_text("plain") == "plain"
    with pytest.raises(AnthropicError):
        system_text([{"type": "image"}])


def test_messages_map_straight_onto_the_one_request() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": NONCE}, {"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "I should call it.", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "stop_sequences": ["END"],
        }
    )
    req = generate_request(body)
    msgs = req.messages or []
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[0]["content"] == "Be brief."
    assert msgs[2]["reasoning"] == "I should call it."
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "w"
    assert msgs[3] == {"role": "tool", "content": "Sunny", "tool_call_id": "t1"}
    assert req.tool_choice == "required" and req.stop == ["END"] and req.max_tokens == 9


def test_a_system_message_among_the_turns_joins_the_system_prompt() -> None:
    # As Claude Code 2.1 sends it: its agent list as a system message after the first turn.
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "You are an agent."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
                {"role": "system", "content": "Available agent types: claude."},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Again."},
            ],
        }
    )
    msgs = generate_request(body).messages or []
    roles = [m["role"] for m in msgs]
    assert roles == ["system", "user", "assistant", "user"], roles
    assert msgs[0]["content"] == "You are an agent.\n\nAvailable agent types: claude."


def test_responses_items_map_straight_onto_the_one_request() -> None:
    body = rt.ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Patch it"}]},
                {"type": "reasoning", "summary": [], "encrypted_content": "Use apply_patch."},
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "X"},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c2", "output": "ok"},
            ],
            "tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
                {"type": "web_search"},
            ],
            "reasoning": {"effort": "minimal"},
            "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
        }
    )
    req, custom = rt.generate_request(body)
    msgs = req.messages or []
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert msgs[2]["reasoning"] == "Use apply_patch."
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == '{"input": "X"}'
    assert [t["function"]["name"] for t in req.tools or []] == ["f", "apply_patch"]
    assert set(custom) == {"apply_patch"} and req.think == "low"
    assert (req.response_format or {})["type"] == "json_schema"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"previous_response_id": "resp_1"}, "stateless"),
        ({"input": [{"type": "teleport"}]}, "teleport"),
        ({"tools": [{"type": "computer_use_preview"}]}, "computer_use_preview"),
        pytest.param(
            {
                "tools": [
                    {
                        "type": "custom",
                        "name": "p",
                        "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("},
                    }
                ]
            },
            "does not compile",
            marks=pytest.mark.slow,  # compiled in a child process
        ),
        ({"reasoning": {"effort": "extreme"}}, "effort"),
    ],
)
def test_responses_bad_input_is_a_400(extra: dict[str, object], words: str) -> None:
    body = rt.ResponsesRequest.model_validate({"model": "m", "input": "hi", **extra})
    with pytest.raises(OpenAIError) as bad:
        _, custom = rt.generate_request(body)
        error = rt.compile_error(custom)  # a grammar compiles in a child, off the loop
        if error is not None:
            raise error
    assert bad.value.status == 400 and words in bad.value.message

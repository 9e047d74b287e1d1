"""OpenAI's request bodies (pydantic), their mapping onto the one GenerateRequest,
and its error shape, as /v1 takes and answers them. A chat message is the request's
own (disagg.frontends.apirequest); the error is the OpenAI-family refusal
(disagg.frontends.refusal)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from disagg.frontends.apirequest import Message, MessageToolCall, MessageToolCallFunction, build
from disagg.frontends.refusal import ApiError as OpenAIError
from disagg_agents.wire.request import GenerateRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonFields(BaseModel):
    model: str
    # Limits are checked once, by disagg_agents.wire.request (a 400 naming the field).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    # vLLM's: requests passing the same salt share cached prompt K/V (default: per API key).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # disagg's: where the prompt is prefilled (auto: the decode agent's estimate;
    # remote: the prefill agent; local: the decode agent), as `disagg generate --placement`.
    placement: Literal["auto", "remote", "local"] = "auto"


class ChatRequest(CommonFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted: calls are parsed as the model makes them
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class CompletionRequest(CommonFields):
    prompt: str
    suffix: str | None = None  # fill-in-the-middle: the text after the completion


def common_request(body: CommonFields, inputs: dict[str, Any]) -> GenerateRequest:
    """The one request from the fields both OpenAI bodies have, and `inputs`
    (the prompt or messages, and what else the endpoint takes)."""
    asked = [getattr(body, "max_completion_tokens", None), body.max_tokens]
    return build(
        next((n for n in asked if n is not None), None),
        temperature=body.temperature,
        top_p=body.top_p,
        stop=body.stop,
        seed=body.seed,
        placement=body.placement,
        **inputs,
    )


def chat_request(body: ChatRequest) -> GenerateRequest:
    """A chat body as the one request."""
    inputs: dict[str, Any] = {"messages": [m.as_request() for m in body.messages]}
    if body.tools:
        inputs.update(tools=body.tools, tool_choice=body.tool_choice)
    elif body.tool_choice not in (None, "none", "auto"):
        raise OpenAIError(
            400,
            "tool_choice names a tool, but no tools were given",
            "invalid_request_error",
            "tool_choice",
        )
    # As sent: the request's one normalizer (GenerateRequest.normalize_format) reads
    # OpenAI's shape; a bad one is a 400 naming response_format.
    inputs["response_format"] = body.response_format
    inputs["think"] = body.reasoning_effort
    return common_request(body, inputs)


__all__ = [
    "ChatRequest",
    "CommonFields",
    "CompletionRequest",
    "Message",
    "OpenAIError",
    "StreamOptions",
    "MessageToolCall",
    "MessageToolCallFunction",
    "chat_request",
    "common_request",
]

"""The chat request every chat API maps onto: OpenAI's chat body is this shape,
and Anthropic's Messages and OpenAI's Responses are translated into it before
`chat_request` makes it the one GenerateRequest. Shared, so no front door
imports another's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from disagg.errors import UsageError
from disagg.frontends import maxtokens
from disagg.frontends.refusal import ApiError
from disagg.serving.request import build_request
from disagg_agents.wire.request import GenerateRequest


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # Text, or OpenAI's content parts ({"type": "text", "text": ...}); None on a tool call.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    # An assistant turn's reasoning, as we return it: under both names clients read.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_request(self) -> dict[str, Any]:
        """This message as the one request type takes it."""
        out: dict[str, Any] = {"role": self.role, "content": _text(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
            out["content"] = out["content"] or None
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"content part of type {part.get('type')!r}: disagg's models take text only",
                "invalid_request_error",
                "messages",
            )
    return "".join(part["text"] for part in content)


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


def common_request(body: CommonFields, inputs: dict[str, Any]) -> GenerateRequest:
    """The one request from the fields every OpenAI-shaped body has, and `inputs`
    (the prompt or messages, and what else the endpoint takes)."""
    asked = [getattr(body, "max_completion_tokens", None), body.max_tokens]
    try:
        return build_request(
            max_tokens=maxtokens.resolve(next((n for n in asked if n is not None), None)),
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop,
            seed=body.seed,
            placement=body.placement,
            **inputs,
        )
    except UsageError as e:
        raise ApiError(400, str(e), "invalid_request_error", e.param) from None


def chat_request(body: ChatRequest) -> GenerateRequest:
    """A chat body as the one request."""
    inputs: dict[str, Any] = {"messages": [m.as_request() for m in body.messages]}
    if body.tools:
        inputs.update(tools=body.tools, tool_choice=body.tool_choice)
    elif body.tool_choice not in (None, "none", "auto"):
        raise ApiError(
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

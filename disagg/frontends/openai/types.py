"""OpenAI's request bodies (pydantic) and its error shape, as /v1 takes and answers them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


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
            raise OpenAIError(
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


class CompletionRequest(CommonFields):
    prompt: str
    suffix: str | None = None  # fill-in-the-middle: the text after the completion


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

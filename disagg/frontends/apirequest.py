"""The one GenerateRequest as every front door builds it, in the request's own terms:
`Message`, a chat message checked as `GenerateRequest.messages` holds it, and
`build`, the request from an API's fields with a bad one refused as a 400.

Each API (disagg.frontends.<api>.types) maps its body onto these straight; none
goes through another API's body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from disagg.errors import UsageError
from disagg.frontends import maxtokens
from disagg.frontends.refusal import ApiError
from disagg.serving.checkedrequest import build_request
from disagg_agents.wire.request import GenerateRequest


class MessageToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class MessageToolCall(BaseModel):
    """A tool call in an assistant message of a chat body (OpenAI's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageToolCallFunction


class Message(BaseModel):
    """A chat message. Typed, so a field of the wrong type (a tool result's id sent
    as a number) is the caller's 400 naming it (disagg.frontends.app)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # Text, or text parts ({"type": "text", "text": ...}); None on a tool call.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
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


def build(max_tokens: int | None, **fields: Any) -> GenerateRequest:
    """The one request from an API's fields (`GenerateRequest`'s names). `max_tokens`
    None: the gateway's default (disagg.frontends.maxtokens). A bad field is an
    ApiError 400 naming it, which each API puts in its own shape."""
    try:
        return build_request(max_tokens=maxtokens.resolve(max_tokens), **fields)
    except UsageError as e:
        raise ApiError(400, str(e), "invalid_request_error", e.param) from None

"""OpenAI's request bodies (pydantic) and its error shape, as /v1 takes and answers
them. The chat body is the shared chat shape (disagg.frontends.chat); the error is
the OpenAI-family refusal (disagg.frontends.refusal)."""

from __future__ import annotations

from disagg.frontends.chat import (
    ChatRequest,
    CommonFields,
    Message,
    StreamOptions,
    ToolCall,
    ToolCallFunction,
)
from disagg.frontends.refusal import ApiError as OpenAIError


class CompletionRequest(CommonFields):
    prompt: str
    suffix: str | None = None  # fill-in-the-middle: the text after the completion


__all__ = [
    "ChatRequest",
    "CommonFields",
    "CompletionRequest",
    "Message",
    "OpenAIError",
    "StreamOptions",
    "ToolCall",
    "ToolCallFunction",
]

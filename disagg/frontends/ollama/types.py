"""Ollama's request bodies (pydantic) and its error, as /api takes them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.frontends.refusal import PlainError

# Ollama's defaults for a model without a Modelfile of its own.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9


# Answered as `{"error": message}` with this status: the shared plain refusal.
OllamaError = PlainError


class Options(BaseModel):
    # Ollama clients send many runner options (num_ctx, top_k, ...); the ones
    # that shape sampling here are mapped, the rest are accepted and ignored.
    model_config = ConfigDict(extra="allow")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None


class CommonFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = True
    options: Options | None = None
    keep_alive: str | float | None = None  # agents stay loaded; accepted
    format: str | dict[str, Any] | None = None  # "", "json", or a JSON Schema
    think: bool | Literal["low", "medium", "high"] | None = None


class GenerateBody(CommonFields):
    prompt: str | None = None
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None  # an assistant turn's reasoning
    tool_calls: list[dict[str, Any]] | None = None  # [{"function": {"name", "arguments"}}]
    tool_name: str | None = None  # a tool result: which function answered

    def as_request(self) -> dict[str, Any]:
        """This message as the one request type takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.thinking:
            out["thinking"] = self.thinking
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
            out["content"] = self.content or None
        if self.tool_name:
            out["name"] = self.tool_name
        return out


class ChatBody(CommonFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # older clients

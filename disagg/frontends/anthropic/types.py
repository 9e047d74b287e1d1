"""Anthropic's Messages request bodies (pydantic) and its error shape, and their
mapping straight onto the one GenerateRequest (`generate_request`), its messages
in the request's own terms (disagg.frontends.apirequest)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from disagg.frontends.apirequest import Message, build
from disagg.frontends.refusal import ApiError
from disagg_agents.wire.request import GenerateRequest

# Claude Code's first system block: a per-request nonce (`cch=...`) that would
# make every turn's prompt differ at its first tokens. Dropped from the prompt.
BILLING_HEADER = "x-anthropic-billing-header:"
# `thinking.budget_tokens` as a reasoning effort: below LOW low, below MEDIUM medium.
THINK_LOW_BELOW, THINK_MEDIUM_BELOW = 4096, 16384


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    fallback = "invalid_request_error" if status < 500 else "api_error"
    kind = ANTHROPIC_ERROR_TYPES.get(status, fallback)
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    def body(self) -> dict[str, Any]:
        return anthropic_error_body(self.status, self.message)


class Tool(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None  # "custom" or absent; server tools are refused

    def as_request(self) -> dict[str, Any]:
        """This tool as the request's function definition."""
        if self.type not in (None, "custom"):
            raise AnthropicError(400, f"tools: tool type {self.type!r} is not served here")
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted: calls come as the model makes them

    def as_request(self) -> str | dict[str, Any]:
        """This choice as the request's tool_choice."""
        if self.type == "tool":
            if not self.name:
                raise AnthropicError(400, "tool_choice: type tool needs a name")
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None  # accepted: thinking is always returned in full

    def effort(self) -> bool | str | None:
        if self.type == "disabled":
            return False
        if self.type == "adaptive" or self.budget_tokens is None:
            return None  # the template's default
        if self.budget_tokens < THINK_LOW_BELOW:
            return "low"
        return "medium" if self.budget_tokens < THINK_MEDIUM_BELOW else "high"


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}

    def think(self) -> str | None:
        return (
            None
            if self.effort is None
            else {"xhigh": "high", "max": "high"}.get(self.effort, self.effort)
        )

    def response_format(self) -> dict[str, Any] | None:
        if self.format is None:
            return None
        if self.format.get("type") != "json_schema" or not isinstance(
            self.format.get("schema"), dict
        ):
            raise AnthropicError(400, "output_config.format: {type: json_schema, schema} only")
        spec = {"name": "output", "schema": self.format["schema"], "strict": True}
        return {"type": "json_schema", "json_schema": spec}


class InMessage(BaseModel):
    # "system": Claude Code sends its agent list as a system message after the first
    # user turn; it joins the system prompt (see chat_messages).
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model: str
    messages: list[InMessage] = Field(min_length=1)
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # accepted, not applied
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model: str
    messages: list[InMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """The system prompt: a string, or text blocks joined by newlines, without
    Claude Code's billing-header block (its nonce would defeat the prefix cache)."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for block in system:
        text = block.get("text")
        if block.get("type") != "text" or not isinstance(text, str):
            raise AnthropicError(400, f"system: block of type {block.get('type')!r}: text only")
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "\n\n".join(texts)


def _block_text(content: Any, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise AnthropicError(400, f"{where}: content must be text or blocks")
    out = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise AnthropicError(400, f"{where}: block of type {kind!r}: disagg's models take text")
        out.append(str(block.get("text", "")))
    return "".join(out)


def _user(i: int, blocks: list[dict[str, Any]]) -> list[Message]:
    """A user turn: its tool results (each a tool message), then its text."""
    out, texts = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            text = _block_text(block.get("content"), f"messages[{i}].tool_result")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append(Message(role="tool", content=text, tool_call_id=block.get("tool_use_id")))
        elif kind == "text":
            texts.append(str(block.get("text", "")))
        else:
            raise AnthropicError(400, f"messages[{i}]: a user block of type {kind!r} is not served")
    if texts:
        out.append(Message(role="user", content="".join(texts)))
    return out


def _assistant(i: int, blocks: list[dict[str, Any]]) -> Message:
    texts, thoughts, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque: nothing a local model can read
        elif kind == "tool_use":
            args = block.get("input") or {}
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": json.dumps(args)},
                }
            )
        else:
            raise AnthropicError(
                400, f"messages[{i}]: an assistant block of type {kind!r} is not served"
            )
    return Message.model_validate(
        {
            "role": "assistant",
            "content": "".join(texts) or (None if calls else ""),
            "tool_calls": calls or None,
            "reasoning": "".join(thoughts) or None,
        }
    )


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[Message]:
    """The conversation as the request's chat messages (system first)."""
    out = []
    # System messages among the turns join the system prompt, in order: a chat
    # template may take a system message only first, and they instruct as it does.
    later = [system_text(m.content) for m in body.messages if m.role == "system"]
    system = "\n\n".join(t for t in [system_text(body.system), *later] if t)
    if system:
        out.append(Message(role="system", content=system))
    for i, m in enumerate(body.messages):
        if m.role == "system":
            continue
        if isinstance(m.content, str):
            out.append(Message(role=m.role, content=m.content))
        elif m.role == "user":
            out += _user(i, m.content)
        else:
            out.append(_assistant(i, m.content))
    return out


def generate_request(body: MessagesRequest) -> GenerateRequest:
    """The Messages body as the one request (its cache salt is the route's to add).
    Raises AnthropicError 400 for a bad field."""
    messages = chat_messages(body)
    if not messages:
        raise AnthropicError(400, "messages: nothing to answer")
    tools = [t.as_request() for t in body.tools or []]
    choice = body.tool_choice.as_request() if body.tool_choice else None
    fields: dict[str, Any] = {"messages": [m.as_request() for m in messages]}
    if tools:
        fields.update(tools=tools, tool_choice=choice)
    fields["response_format"] = body.output_config.response_format() if body.output_config else None
    try:
        return build(
            body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop_sequences or None,
            think=think(body),
            **fields,
        )
    except ApiError as e:
        raise AnthropicError(e.status, e.message, e.headers) from None


def think(body: MessagesRequest) -> bool | str | None:
    """The reasoning asked for: `output_config.effort` over `thinking`."""
    if body.output_config is not None and body.output_config.effort is not None:
        return body.output_config.think()
    return body.thinking.effort() if body.thinking is not None else None

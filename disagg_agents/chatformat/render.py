"""A request as prompt token ids: the tokenizer's own chat template renders the
conversation (we only put the messages in the shape templates read), except
harmony, which openai-harmony's rendering defines (disagg_agents.chatformat.harmony).
Message text is text either way: only the template's markup is special tokens."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from . import generic, harmony
from .detect import ChatFormat
from .literal import text_encoder


class FormatError(ValueError):
    """The request asks for something this model's format cannot do."""


def tool_call_args(args: Any) -> dict[str, Any]:
    """A tool call's arguments as an object: clients send an object (Ollama) or
    a JSON string (OpenAI); templates iterate or `tojson` them."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise FormatError(f"tool call arguments are not valid JSON: {e}") from None
    if not isinstance(args, Mapping):
        raise FormatError("tool call arguments must be a JSON object")
    return dict(args)


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function", call)
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": tool_call_args(fn.get("arguments"))},
        }
        entry["id"] = call.get("id") or f"call_{i}"
        out.append(entry)
    return out


def chat_messages(
    messages: list[dict[str, Any]], system: str | None, fmt: ChatFormat
) -> list[dict[str, Any]]:
    """Messages as the templates read them: assistant reasoning (sent as
    `thinking`, `reasoning_content` or `reasoning`) under the names templates use
    (`thinking`: harmony; `reasoning_content`: Qwen3), tool call arguments as
    objects, no None content."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = m.get("content") or ""
        if m["role"] == "assistant":
            thinking = m.get("thinking") or m.get("reasoning_content") or m.get("reasoning")
            for key in ("thinking", "reasoning_content", "reasoning"):
                msg.pop(key, None)
            if not thinking and fmt.reasoning and "</think>" in msg["content"]:
                # A client that sent the answer back with its think block: apart, as
                # Qwen3's template splits it (its text is escaped before the template).
                head, _, msg["content"] = msg["content"].rpartition("</think>")
                thinking = head.split("<think>")[-1].strip("\n")
                msg["content"] = msg["content"].lstrip("\n")
            if thinking:
                msg["thinking"] = msg["reasoning_content"] = thinking
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"])
            else:
                msg.pop("tool_calls", None)
        out.append(msg)
    return out


def template_kwargs(fmt: ChatFormat, think: bool | str | None) -> dict[str, Any]:
    """Reasoning settings as the template takes them: harmony's
    `reasoning_effort`, Qwen3's `enable_thinking`."""
    if think is None:
        return {}
    if fmt.kind == "harmony":
        # Harmony always reasons; "no thinking" is its least effort.
        return {
            "reasoning_effort": think if isinstance(think, str) else "medium" if think else "low"
        }
    if fmt.reasoning:
        return {"enable_thinking": think is not False}
    if think is False:
        return {}
    raise FormatError(
        "think: this model does not reason apart (its chat template has no <think> "
        "or harmony channels); leave think out or set it to false"
    )


def render_chat(
    tokenizer: Any,
    fmt: ChatFormat,
    messages: list[dict[str, Any]],
    *,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    think: bool | str | None = None,
    forced: bool = False,
    structured: bool = False,
) -> list[int]:
    """The conversation through the tokenizer's chat template (harmony: as
    openai-harmony renders it), ending where the assistant speaks next; every
    text the request carries is tokenized as text. Raises FormatError for what
    the model cannot take.

    forced: a tool call is forced by constrained decoding (tool_choice
    "required" or a named function), so a template without tools is no refusal.
    structured: an output grammar (response_format) constrains the answer.
    A template without tools otherwise gets them in the generic format
    (`generic`): described in the system prompt, the answer a JSON call or reply.
    """
    if fmt.kind == "harmony":
        try:
            convo = harmony.conversation(messages, system=system, tools=tools or None, think=think)
            return harmony.encode(tokenizer, fmt.special_ids, harmony.segments(convo))
        except harmony.HarmonyError as e:
            raise FormatError(str(e)) from None
    if not fmt.template:
        raise FormatError("this model has no chat template: send a raw prompt instead")
    kwargs = template_kwargs(fmt, think)
    if tools and fmt.tools:
        kwargs["tools"] = tools
    elif generic.applies(fmt, tools, forced, structured):
        assert tools is not None
        messages, system = generic.messages(messages, system, tools)
    elif tools and not forced:
        raise FormatError(
            "tools: this model's chat template does not take tools, and its answer is "
            "already constrained (response_format) or it reasons apart, so it cannot "
            "call them; send the request without tools or without response_format"
        )
    msgs = chat_messages(messages, system, fmt)
    enc = text_encoder(tokenizer)
    marker = enc.marker(msgs, kwargs)
    try:
        text = tokenizer.apply_chat_template(
            enc.escape(msgs, marker),
            add_generation_prompt=True,
            tokenize=False,
            **enc.escape(kwargs, marker),
        )
    except Exception as e:  # jinja's raise_exception and friends: the messages are wrong
        raise FormatError(f"the chat template refused the messages: {e}") from None
    return enc.markup_ids(str(text), marker)


def render_fim(tokenizer: Any, fmt: ChatFormat, prefix: str, suffix: str) -> list[int]:
    """Fill-in-the-middle, prefix-suffix-middle order: the model writes the middle."""
    if fmt.fim is None:
        raise FormatError(
            "suffix: this model's tokenizer has no fill-in-the-middle tokens "
            "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>); send the prompt without suffix"
        )
    pre, suf, mid = fmt.fim

    enc = text_encoder(tokenizer).encode  # code that holds "<|fim_middle|>" is text too
    return [pre, *enc(prefix), suf, *enc(suffix), mid]

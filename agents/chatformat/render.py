"""A request as prompt token ids: the tokenizer's own chat template renders the
conversation; we only put the messages in the shape templates read."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .detect import ChatFormat


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
    """Messages as the templates read them: assistant reasoning under both names
    templates use (`thinking`: harmony; `reasoning_content`: Qwen3), tool call
    arguments as objects, no None content."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = m.get("content") or ""
        if m["role"] == "assistant":
            thinking = m.get("thinking") or m.get("reasoning_content")
            msg.pop("thinking", None)
            msg.pop("reasoning_content", None)
            if thinking:
                msg["thinking"] = msg["reasoning_content"] = thinking
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"])
            else:
                msg.pop("tool_calls", None)
        out.append(msg)
    return _one_call_per_turn(out) if fmt.kind == "harmony" else out


def _one_call_per_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Harmony carries one call per assistant message, its result right after
    it (the template names a result by the latest call): split parallel calls,
    each followed by its result (matched by tool_call_id, else in order)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        results = []
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            results.append(messages[j])
            j += 1
        by_id = {r.get("tool_call_id"): r for r in results if r.get("tool_call_id")}
        rest = [r for r in results if not r.get("tool_call_id")]
        for n, call in enumerate(calls):
            turn = {"role": "assistant", "content": "", "tool_calls": [call]}
            if n == 0 and m.get("thinking"):
                turn["thinking"] = turn["reasoning_content"] = m["thinking"]
            out.append(turn)
            result = by_id.pop(call["id"], None) or (rest.pop(0) if rest else None)
            if result is not None:
                out.append(result)
        out.extend([*by_id.values(), *rest])
        i = j
    # Harmony's template refuses content and thinking together on a tool-call
    # turn: the reasoning is what led to the call, keep it.
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls") and m.get("thinking"):
            m["content"] = ""
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
) -> list[int]:
    """The conversation through the tokenizer's chat template, ending where the
    assistant speaks next. Raises FormatError for what the model cannot take.

    forced: a tool call is forced by constrained decoding (tool_choice
    "required" or a named function), so a template without tools is no refusal.
    """
    if not fmt.template:
        raise FormatError("this model has no chat template: send a raw prompt instead")
    kwargs = template_kwargs(fmt, think)
    if tools and fmt.tools:
        kwargs["tools"] = tools
    elif tools and not forced:
        raise FormatError(
            "tools: this model's chat template does not take tools, so it cannot call "
            "them; send the request without tools (or force a call with tool_choice)"
        )
    msgs = chat_messages(messages, system, fmt)
    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)
    except Exception as e:  # jinja's raise_exception and friends: the messages are wrong
        raise FormatError(f"the chat template refused the messages: {e}") from None
    if isinstance(ids, Mapping):  # some tokenizers answer a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def render_fim(tokenizer: Any, fmt: ChatFormat, prefix: str, suffix: str) -> list[int]:
    """Fill-in-the-middle, prefix-suffix-middle order: the model writes the middle."""
    if fmt.fim is None:
        raise FormatError(
            "suffix: this model's tokenizer has no fill-in-the-middle tokens "
            "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>); send the prompt without suffix"
        )
    pre, suf, mid = fmt.fim

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    return [pre, *enc(prefix), suf, *enc(suffix), mid]

"""Tools on a model whose chat template takes none: the generic format (as
llama.cpp's server does it). The tools are described in the system prompt, and
the decode agent's grammar makes the answer one JSON object, either

    {"tool_call": {"name": NAME, "arguments": {...}}}   (valid for that tool's schema)
    {"response": "text for the user"}

Earlier calls and their results go back to the model in the same JSON, as
ordinary messages, so any template renders them. A small model follows the
shape because the grammar leaves it nothing else to write; what it says inside
is its own.
"""

from __future__ import annotations

import json
from typing import Any

from .detect import ChatFormat
from .parse import Event, ParsedCall, Piece

RESPONSE_HEAD = '{"response": "'
CALL_HEAD = '{"tool_call": '
INSTRUCTIONS = (
    "Answer with exactly one JSON object. To reply to the user:\n"
    '{"response": "<your reply>"}\n'
    "Only when you need a tool's result first, call one tool:\n"
    '{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}}\n'
    "You will then get its result and answer again."
)


def applies(fmt: ChatFormat, tools: Any, forced: bool, structured: bool) -> bool:
    """Whether a request's tools go through the generic format: the template has
    no tool markup, the model does not reason apart (its <think> would need the
    grammar to start later), and neither a forced call nor an output grammar
    already decides what the answer is."""
    return (
        bool(tools)
        and not fmt.tools
        and fmt.kind == "plain"
        and not fmt.reasoning
        and not forced
        and not structured
    )


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The system prompt's description of the tools, one JSON line each."""
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        entry = {"name": fn.get("name"), "description": fn.get("description") or ""}
        entry["parameters"] = fn.get("parameters") or {"type": "object"}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "You can use these tools:\n" + "\n".join(lines) + "\n\n" + INSTRUCTIONS


def messages(
    msgs: list[dict[str, Any]], system: str | None, tools: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], str]:
    """(messages, system) with the tools in the system prompt, earlier calls as
    the assistant's JSON and tool results as user messages (templates without
    tools may not know a `tool` role, or want roles to alternate)."""
    head = tools_text(tools)
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> tool name, to label its result
    for m in msgs:
        role = m.get("role")
        if role == "system" and not out:
            system = "\n\n".join(s for s in (system, _text(m.get("content"))) if s)
        elif role == "assistant" and m.get("tool_calls"):
            if _text(m.get("content")):
                out.append(_said(m["content"]))
            for i, call in enumerate(m["tool_calls"]):
                fn = call.get("function", call)
                args = fn.get("arguments")
                if isinstance(args, str):
                    args = json.loads(args) if args.strip() else {}
                names[str(call.get("id") or f"call_{i}")] = fn["name"]
                body = {"tool_call": {"name": fn["name"], "arguments": args}}
                out.append({"role": "assistant", "content": json.dumps(body, ensure_ascii=False)})
        elif role == "assistant":
            out.append(_said(m.get("content")))
        elif role == "tool":
            name = m.get("name") or names.get(str(m.get("tool_call_id")), "")
            body = {"tool_response": {"name": name, "content": _text(m.get("content"))}}
            out.append({"role": "user", "content": json.dumps(body, ensure_ascii=False)})
        else:
            out.append(m)
    return out, "\n\n".join(s for s in (system, head) if s)


def _said(content: Any) -> dict[str, Any]:
    body = json.dumps({"response": _text(content)}, ensure_ascii=False)
    return {"role": "assistant", "content": body}


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


class GenericParser:
    """The answer's JSON, read as it comes: a response's string is content,
    streamed (escapes decoded as they complete); a tool call is read whole at
    the end. Text in neither shape (no grammar held it) is content as written."""

    def __init__(self) -> None:
        self.buf = ""  # everything written so far
        self.shown = 0  # characters of the response string already sent
        self.done = False  # the response string has closed

    @property
    def mode(self) -> str:
        if self.buf.startswith(RESPONSE_HEAD):
            return "content"
        if self.buf.startswith(CALL_HEAD):
            return "tool"
        return "markup"

    def text(self, s: str) -> list[Event]:
        self.buf += s
        if self.done or not self.buf.startswith(RESPONSE_HEAD):
            return []
        decoded, self.done = json_string_prefix(self.buf[len(RESPONSE_HEAD) :])
        new, self.shown = decoded[self.shown :], len(decoded)
        return [Piece("content", new)] if new else []

    def special(self, name: str) -> list[Event]:
        return []

    def finish(self, cut: bool = False) -> list[Event]:
        if self.buf.startswith(RESPONSE_HEAD):
            return []
        if self.buf.startswith(CALL_HEAD):
            try:
                call = json.loads(self.buf)["tool_call"]
                args = call["arguments"]
                return [ParsedCall(call["name"], args, json.dumps(args, ensure_ascii=False))]
            except (json.JSONDecodeError, KeyError, TypeError):
                return []  # cut short: a call that never closed is no call
        if any(self.buf.startswith(h[: len(self.buf)]) for h in (RESPONSE_HEAD, CALL_HEAD)):
            return []  # cut inside the opening: nothing was said yet
        return [Piece("content", self.buf)]


ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def json_string_prefix(raw: str) -> tuple[str, bool]:
    """The text of a JSON string's body written so far (after its opening quote),
    up to its last complete character; and whether the closing quote came."""
    out: list[str] = []
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == '"':
            return "".join(out), True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(raw):
            break  # an escape split over tokens: wait for the rest
        e = raw[i + 1]
        if e != "u":
            out.append(ESCAPES.get(e, e))
            i += 2
            continue
        if i + 6 > len(raw):
            break
        code = _hex(raw[i + 2 : i + 6])
        if 0xD800 <= code < 0xDC00:  # a surrogate pair's first half: wait for its second
            if i + 12 > len(raw):
                break
            low = _hex(raw[i + 8 : i + 12])
            if 0xDC00 <= low < 0xE000:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
        out.append(chr(code) if code >= 0 and not 0xD800 <= code < 0xE000 else "\ufffd")
        i += 6
    return "".join(out), False


def _hex(digits: str) -> int:
    try:
        return int(digits, 16)
    except ValueError:  # not JSON (no grammar held it): no character
        return -1

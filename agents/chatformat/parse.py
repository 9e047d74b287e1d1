"""Streaming parsers: a model's output, piece by piece, split into reasoning,
content and tool calls.

Each parser takes decoded text (`text`) and, for harmony, its markup tokens by
name (`special`), and answers the events they complete. Text that could still
become a tag is held back, so reasoning never leaks into content, even when a
tag arrives split over several tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Piece:
    """Visible text on one channel: "content" (the answer) or "reasoning"."""

    channel: str
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


Event = Piece | ToolCall


class PlainParser:
    """No format: all text is content (today's behaviour)."""

    mode = "content"

    def text(self, s: str) -> list[Event]:
        return [Piece("content", s)] if s else []

    def special(self, name: str) -> list[Event]:
        return []

    def finish(self) -> list[Event]:
        return []


def _tool_call(name: Any, args: Any) -> ToolCall | None:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, Mapping):
        return None
    return ToolCall(name, dict(args))


# -- harmony -------------------------------------------------------------------

_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser:
    """OpenAI's harmony: `<|start|>{role}<|channel|>{channel} [to=R] [<|constrain|>json]
    <|message|>{text}<|end|>|<|return|>|<|call|>`. The recipient may also stand
    right after the role. analysis is reasoning; final (and commentary without
    a recipient: a preamble for the user) is content; a message to a recipient
    is a tool call. Header text is never shown."""

    def __init__(self) -> None:
        self.state = "outside"  # outside | header | body
        self.header = ""
        self.channel = ""
        self.recipient: str | None = None
        self.body: list[str] = []  # a tool call's arguments, until it ends

    @property
    def mode(self) -> str:
        """What the next text is: markup, reasoning, content or tool (arguments)."""
        if self.state == "header":
            return "markup"
        if self.state == "outside":
            return "content"
        return self._body_kind()

    def _body_kind(self) -> str:
        if self.recipient is not None:
            return "tool"
        return "reasoning" if self.channel == "analysis" else "content"

    def text(self, s: str) -> list[Event]:
        if not s:
            return []
        if self.state == "header":
            self.header += s
            return []
        kind = self.mode
        if kind == "tool":
            self.body.append(s)
            return []
        return [Piece(kind, s)]

    def special(self, name: str) -> list[Event]:
        if name == "<|start|>":
            out = self._close()
            self.state, self.header = "header", ""
            return out
        if name in ("<|channel|>", "<|constrain|>"):
            out = self._close() if self.state == "body" else []
            if self.state != "header":
                self.state, self.header = "header", ""
            self.header += f" {name} "
            return out
        if name == "<|message|>":
            out = self._close() if self.state == "body" else []
            self._open()
            return out
        # <|end|>, <|return|>, <|call|>: the message ends.
        out = self._close()
        self.state = "outside"
        return out

    def finish(self) -> list[Event]:
        return self._close()

    def _open(self) -> None:
        """The header is complete: read its channel and recipient."""
        _, _, after = self.header.partition("<|channel|>")
        words = after.replace("<|constrain|>", " ").split()
        self.channel = words[0] if words and not words[0].startswith("to=") else ""
        found = _RECIPIENT.search(self.header)
        self.recipient = found.group(1) if found else None
        self.state, self.body = "body", []

    def _close(self) -> list[Event]:
        """End the current message: a tool call is complete now."""
        out: list[Event] = []
        if self.state == "body" and self.recipient is not None:
            raw = "".join(self.body)
            name = self.recipient.removeprefix("functions.")
            call = _tool_call(name, raw)
            # Arguments that are no JSON object come back as text, never as markup.
            out.append(call if call is not None else Piece("content", raw))
        self.state, self.recipient, self.channel, self.body = "outside", None, "", []
        return out


# -- Qwen3 tags ----------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_qwen_json(body: str, tools: list[dict[str, Any]] | None) -> ToolCall | None:
    """Qwen3: `{"name": ..., "arguments": {...}}`."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, Mapping):
        return None
    return _tool_call(obj.get("name"), obj.get("arguments", {}))


def parse_qwen_xml(body: str, tools: list[dict[str, Any]] | None) -> ToolCall | None:
    """Qwen3-Coder: `<function=NAME><parameter=ARG>value</parameter></function>`,
    values typed by the tool's parameter schema: mlx-lm's parser."""
    from mlx_lm.tool_parsers import qwen3_coder

    try:
        call = qwen3_coder.parse_tool_call(body.strip(), tools)
    except ValueError:
        return None
    return _tool_call(call.get("name"), call.get("arguments", {}))


class _JsonQuotes:
    """Whether a position of a growing JSON text is inside a string, read once
    from the start however often it is asked (a call's body grows by a token)."""

    def __init__(self) -> None:
        self.pos = 0
        self.inside = self.escaped = False

    def inside_at(self, text: str, end: int) -> bool:
        """Whether text[end] is inside a string; `end` never goes back."""
        for ch in text[self.pos : end]:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = self.inside
            elif ch == '"':
                self.inside = not self.inside
        self.pos = end
        return self.inside


def _held(buf: str, tags: tuple[str, ...]) -> int:
    """Where the part of `buf` that could still become one of `tags` starts."""
    for k in range(min(len(buf), max(map(len, tags)) - 1), 0, -1):
        if any(t.startswith(buf[-k:]) for t in tags):
            return len(buf) - k
    return len(buf)


class TagParser:
    """Qwen3's `<think>…</think>` reasoning and `<tool_call>…</tool_call>` calls
    in plain text. Whitespace next to a tag is the format's, not the answer's."""

    def __init__(
        self,
        *,
        think: bool,
        tool_parser: Any = None,  # parse_qwen_json / parse_qwen_xml, None: no tool calls
        tools: list[dict[str, Any]] | None = None,
        reasoning_first: bool = False,  # the prompt ends inside <think>
        structured: bool = False,  # the answer follows an output grammar (response_format)
    ) -> None:
        self.think = think
        self.tool_parser = tool_parser
        self.tools = tools
        self.state = "reasoning" if reasoning_first else "content"
        self.buf = ""
        self.lead = True  # drop whitespace at the start of a section
        # Under an output grammar the answer is the grammar's text: once it has begun, a
        # "<think>" in it (say inside a JSON string) is its text, not reasoning. Free
        # text keeps hiding any markup the model writes.
        self.structured = structured
        self.answered = False
        self.quotes = _JsonQuotes()  # a JSON call's strings, read as its body grows
        self.skip = 0  # close tags before this in a call's body are its text

    @property
    def mode(self) -> str:
        return "tool" if self.state == "tool" else self.state

    def _tags(self) -> tuple[str, ...]:
        if self.state == "reasoning":
            return (THINK_CLOSE,)
        if self.state == "tool":
            return (CALL_CLOSE,)
        tags = (THINK_OPEN,) if self.think and not self.answered else ()
        return (*tags, CALL_OPEN) if self.tool_parser else tags

    def _piece(self, text: str, out: list[Event]) -> None:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        if text:
            out.append(Piece(self.state, text))
            self.answered = self.answered or (self.structured and self.state == "content")

    def text(self, s: str) -> list[Event]:
        self.buf += s
        out: list[Event] = []
        while self.buf:
            tags = self._tags()
            if not tags:
                self._piece(self.buf, out)
                self.buf = ""
                break
            found = [
                (i, t)
                for t in tags
                if (i := self._find(t)) >= 0
                and not (self.structured and t == THINK_OPEN and self.buf[:i].strip())
            ]
            if not found:
                if self.state != "tool":
                    # Hold back a possible tag start, and trailing whitespace a tag would drop.
                    cut = _held(self.buf, tags)
                    cut = len(self.buf[:cut].rstrip())
                    self._piece(self.buf[:cut], out)
                    self.buf = self.buf[cut:]
                break
            i, tag = min(found)
            before, self.buf = self.buf[:i], self.buf[i + len(tag) :]
            if self.state == "tool":
                self._end_call(before, out)
            else:
                self._piece(before.rstrip(), out)
            self.state = {THINK_OPEN: "reasoning", CALL_OPEN: "tool"}.get(tag, "content")
            self.lead, self.quotes, self.skip = True, _JsonQuotes(), 0
        return out

    def _find(self, tag: str) -> int:
        """Where `tag` stands in the buffer, -1 if nowhere. Seen under a forced call:
        a random model put the token "</tool_call>" inside a JSON argument, which the
        grammar allows, and the call was cut there. A close tag inside a JSON
        call's string, or before an XML call's </function>, is the call's text."""
        if self.state != "tool":
            return self.buf.find(tag)
        i = self.buf.find(tag, self.skip)
        while i >= 0 and self._inside_call(i):
            self.skip = i + 1  # each tag is judged once, however the body grows
            i = self.buf.find(tag, self.skip)
        return i

    def _inside_call(self, i: int) -> bool:
        if self.tool_parser is parse_qwen_json:
            return self.quotes.inside_at(self.buf, i)
        return self.tool_parser is parse_qwen_xml and self.buf.find("</function>", 0, i) < 0

    def _end_call(self, body: str, out: list[Event]) -> None:
        call = self.tool_parser(body, self.tools)
        if call is not None:
            out.append(call)
        else:  # not a call after all: its text is the answer's
            self.state = "content"
            self._piece(body.strip(), out)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        buf, self.buf = self.buf, ""
        if self.state == "tool":  # cut short: keep the call if it is whole
            body, tag, rest = buf.partition(CALL_CLOSE)
            if tag and self.tool_parser(buf, self.tools) is None:
                # A string that never closed held the close tag: it was one after all.
                self._end_call(body, out)
                self.state, self.lead = "content", True
                return out + self.text(rest) + self.finish()
            self._end_call(buf, out)
        else:
            self._piece(buf.rstrip() if self.state == "reasoning" else buf, out)
        self.state = "content"
        return out

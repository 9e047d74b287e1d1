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

from . import qwenxml


@dataclass(frozen=True)
class Piece:
    """Visible text on one channel: "content" (the answer) or "reasoning"."""

    channel: str
    text: str


@dataclass(frozen=True)
class ParsedCall:
    """A tool call as parsed from the model's text (the wire carries it as
    disagg_agents.wire.answer.ToolCall)."""

    name: str
    arguments: dict[str, Any]
    text: str | None = None  # the arguments as the model wrote them, where it wrote JSON

    def to_dict(self) -> dict[str, Any]:
        """DONE's form; `arguments_text` lets a client send the call back byte-exact."""
        out: dict[str, Any] = {"name": self.name, "arguments": self.arguments}
        if self.text is not None:
            out["arguments_text"] = self.text
        return out


Event = Piece | ParsedCall


class PlainParser:
    """No format: all text is content (today's behaviour)."""

    mode = "content"

    def text(self, s: str) -> list[Event]:
        return [Piece("content", s)] if s else []

    def special(self, name: str) -> list[Event]:
        return []

    def finish(self, cut: bool = False) -> list[Event]:
        return []


class CallParser:
    """A forced call on a template without tool markup: the grammar makes the
    whole answer `{"name": ..., "arguments": {...}}`, read once it ends."""

    mode = "tool"

    def __init__(self) -> None:
        self.buf: list[str] = []

    def text(self, s: str) -> list[Event]:
        self.buf.append(s)
        return []

    def special(self, name: str) -> list[Event]:
        return []

    def finish(self, cut: bool = False) -> list[Event]:
        body, self.buf = "".join(self.buf), []
        call = parse_qwen_json(body, None)
        if call is not None:
            return [call]
        # Cut short, the call is no answer; otherwise what was written is.
        return [] if cut or not body.strip() else [Piece("content", body)]


def _tool_call(name: Any, args: Any, text: str | None = None) -> ParsedCall | None:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, Mapping):
        return None
    return ParsedCall(name, dict(args), text)


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

    def finish(self, cut: bool = False) -> list[Event]:
        """cut: max_tokens ended the answer; a call still open is no call, and
        its partial arguments are no answer either: dropped."""
        if cut and self.state == "body" and self.recipient is not None:
            self.state, self.recipient, self.body = "outside", None, []
            return []
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
            call = _tool_call(name, raw, raw)
            # Arguments that are no JSON object come back as text, never as markup.
            out.append(call if call is not None else Piece("content", raw))
        self.state, self.recipient, self.channel, self.body = "outside", None, "", []
        return out


# -- Qwen3 tags ----------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = qwenxml.FUNCTION, qwenxml.FUNCTION_END
XML_MARKUP = (FUNCTION_OPEN, qwenxml.PARAMETER, CALL_OPEN)


def parse_qwen_json(body: str, tools: list[dict[str, Any]] | None) -> ParsedCall | None:
    """Qwen3: `{"name": ..., "arguments": {...}}`."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, Mapping):
        return None
    return _tool_call(obj.get("name"), obj.get("arguments", {}))


def parse_qwen_xml(body: str, tools: list[dict[str, Any]] | None) -> ParsedCall | None:
    """Qwen3-Coder: `<function=NAME><parameter=ARG>value</parameter></function>`,
    values typed by the tool's parameter schema, missing close tags recovered."""
    found = qwenxml.parse_call(body, tools)
    return None if found is None else _tool_call(*found)


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
        # Qwen3-Coder may open a call with <function= alone, after prose: such a
        # call ends at its </function>.
        self.xml = tool_parser is parse_qwen_xml
        self.bare = False

    @property
    def mode(self) -> str:
        return "tool" if self.state == "tool" else self.state

    def _tags(self) -> tuple[str, ...]:
        if self.state == "reasoning":
            return (THINK_CLOSE,)
        if self.state == "tool":
            return (CALL_CLOSE, FUNCTION_CLOSE) if self.bare else (CALL_CLOSE,)
        tags = (THINK_OPEN,) if self.think and not self.answered else ()
        if not self.tool_parser:
            return tags
        # A stray </tool_call> (after a bare call) is markup too: dropped.
        return (*tags, CALL_OPEN, CALL_CLOSE, *((FUNCTION_OPEN,) if self.xml else ()))

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
                self._end_call(before + (tag if tag == FUNCTION_CLOSE else ""), out)
            else:
                self._piece(before.rstrip(), out)
            self.bare = tag == FUNCTION_OPEN
            if self.bare:
                self.buf = tag + self.buf  # the call's own first tag
            self.state = {THINK_OPEN: "reasoning", CALL_OPEN: "tool", FUNCTION_OPEN: "tool"}.get(
                tag, "content"
            )
            self.lead, self.quotes, self.skip = True, _JsonQuotes(), 0
        return out

    def _find(self, tag: str) -> int:
        """Where `tag` stands in the buffer, -1 if nowhere. Seen under a forced call:
        a random model put the token "</tool_call>" inside a JSON argument, which the
        grammar allows, and the call was cut there. A close tag inside a JSON
        call's string, or before an XML call's </function>, is the call's text."""
        if self.state != "tool" or tag == FUNCTION_CLOSE:
            return self.buf.find(tag)
        i = self.buf.find(tag, self.skip)
        while i >= 0 and self._inside_call(i):
            self.skip = i + 1  # each tag is judged once, however the body grows
            i = self.buf.find(tag, self.skip)
        return i

    def _inside_call(self, i: int) -> bool:
        if not self.xml:
            return self.quotes.inside_at(self.buf, i)
        # XML: inside a parameter's value that has not ended (no </parameter>, no
        # </function> after its opening tag).
        head = self.buf[:i]
        at = head.rfind(qwenxml.PARAMETER)
        return (
            at >= 0 and qwenxml.PARAMETER_END not in head[at:] and FUNCTION_CLOSE not in head[at:]
        )

    def _whole(self, body: str) -> bool:
        """Whether a call's body is complete: JSON that parses, XML that ends."""
        if self.xml:
            return FUNCTION_CLOSE in body
        return self.tool_parser(body, self.tools) is not None

    def _end_call(self, body: str, out: list[Event]) -> None:
        call = self.tool_parser(body, self.tools)
        self.bare = False
        if call is not None:
            out.append(call)
        elif not (self.xml and any(t in body for t in XML_MARKUP)):
            # not a call after all: its text is the answer's (an XML call's markup never is)
            self.state = "content"
            self._piece(body.strip(), out)

    def finish(self, cut: bool = False) -> list[Event]:
        """cut: max_tokens ended the answer, and a call still open is dropped.
        Otherwise (the model stopped) a call is recovered as far as it goes."""
        out: list[Event] = []
        buf, self.buf = self.buf, ""
        if self.state == "tool" and (not cut or self._whole(buf)):
            body, tag, rest = buf.partition(CALL_CLOSE)
            if tag and not self._whole(buf):
                # A value that never closed held the close tag: it was one after all.
                self._end_call(body, out)
                self.state, self.lead = "content", True
                return out + self.text(rest) + self.finish()
            self._end_call(buf, out)
        elif self.state == "tool":
            pass  # cut inside a call: neither a call nor an answer
        elif cut and buf.strip() and any(t.startswith(buf.strip()) for t in self._tags()):
            pass  # a tag the cut left half-written is markup, not text
        else:
            self._piece(buf.rstrip() if self.state == "reasoning" else buf, out)
        self.state = "content"
        return out

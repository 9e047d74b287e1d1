"""A model's output token by token: the tokenizer's streaming detokenizer for
the text, a format's parser for its meaning, and what has been said so far."""

from __future__ import annotations

from typing import Any

from . import generic
from .detect import ChatFormat
from .parse import (
    CallParser,
    Event,
    HarmonyParser,
    ParsedCall,
    Piece,
    PlainParser,
    TagParser,
    parse_qwen_json,
    parse_qwen_xml,
)


class ChatStream:
    """Feed token ids with `add`, then `finish`; each answers the events that
    token completed. Harmony's markup tokens never go through the detokenizer:
    each one flushes it, so no markup text exists at all."""

    def __init__(
        self,
        detokenizer: Any,
        parser: Any,
        markup: dict[int, str],
        hidden: frozenset[int] = frozenset(),
    ) -> None:
        self.detok = detokenizer
        self.detok.reset()
        self.parser = parser
        self.markup = markup
        # Special tokens no format gives a meaning (<|im_start|>, <|endoftext|>): in a
        # chat answer they are never text, as servers skip them (vLLM, Ollama).
        self.hidden = hidden
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ParsedCall] = []

    @property
    def mode(self) -> str:
        """What the model is writing now: "content", "reasoning", "tool"
        (a call's arguments) or "markup" (a harmony header)."""
        return str(self.parser.mode)

    def add(self, tid: int) -> list[Event]:
        name = self.markup.get(tid)
        if name is not None:
            return self._keep(self._flush() + self.parser.special(name))
        if tid in self.hidden:
            return self._keep(self._flush())
        self.detok.add_token(tid)
        return self._keep(self.parser.text(self.detok.last_segment))

    def finish(self, cut: bool = False) -> list[Event]:
        """The answer has ended; cut: by max_tokens (a call still open is dropped)."""
        return self._keep(self._flush(last=True) + self.parser.finish(cut))

    def _flush(self, last: bool = False) -> list[Event]:
        self.detok.finalize()
        tail = self.detok.last_segment
        self.detok.reset()
        if last:  # max_tokens cut a character's bytes short (an emoji): drop them, not "\ufffd"
            tail = tail.rstrip("\ufffd")
        return self.parser.text(tail) if tail else []

    def _keep(self, events: list[Event]) -> list[Event]:
        for e in events:
            if isinstance(e, ParsedCall):
                self.tool_calls.append(e)
            else:
                (self.reasoning if e.channel == "reasoning" else self.content).append(e.text)
        return events

    def result(self) -> dict[str, Any]:
        """What DONE carries: `text` (content only), and `reasoning` and
        `tool_calls` when there are any."""
        out: dict[str, Any] = {"text": "".join(self.content)}
        if self.reasoning:
            out["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return out


def open_stream(
    fmt: ChatFormat,
    tokenizer: Any,
    prompt_ids: list[int],
    *,
    chat: bool = True,
    tools: list[dict[str, Any]] | None = None,
    detokenizer: Any = None,
    structured: bool = False,
    forced: bool = False,
) -> ChatStream:
    """The stream for one request's answer.

    chat: the prompt went through the chat template (False: raw or FIM; Qwen's
    tags are then plain text, harmony's markup tokens still never show).
    tools: the request's tools; Qwen's tool calls are parsed only when given.
    structured: the answer follows an output grammar (its text is kept whole).
    forced: tool_choice forces a call; on a template without tool markup the
    grammar makes the whole answer the call's JSON, read as the call.
    """
    detok = detokenizer if detokenizer is not None else tokenizer.detokenizer
    # Raw and FIM prompts keep every token's text, as mlx-lm's own generation does.
    hidden = special_ids(tokenizer) if chat else frozenset()
    if fmt.kind == "harmony":
        markup = {i: n for n, i in fmt.special_ids.items()}
        harmony = _harmony_after(prompt_ids, markup, tokenizer)
        return ChatStream(detok, harmony, markup, hidden - set(markup))
    if chat and generic.applies(fmt, tools, forced, structured):
        return ChatStream(detok, generic.GenericParser(), {}, hidden)
    if chat and forced and tools and fmt.kind == "plain" and not fmt.reasoning:
        return ChatStream(detok, CallParser(), {}, hidden)
    if not chat or (fmt.kind == "plain" and not fmt.reasoning):
        return ChatStream(detok, PlainParser(), {}, hidden)
    tool_parser = None
    if tools and fmt.kind in ("qwen_json", "qwen_xml"):
        tool_parser = parse_qwen_xml if fmt.kind == "qwen_xml" else parse_qwen_json
    tail = tokenizer.decode(prompt_ids[-8:]) if prompt_ids else ""
    first = fmt.reasoning and tail.rstrip().endswith("<think>")
    parser = TagParser(
        think=fmt.reasoning,
        tool_parser=tool_parser,
        tools=tools,
        reasoning_first=first,
        structured=structured,
    )
    return ChatStream(detok, parser, {}, hidden)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Every special token: the named ones (eos, pad, ...) and the added tokens
    marked special (<|im_start|>, <|file_sep|>, ...), which not all configs name."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    return frozenset(ids)


def _harmony_after(prompt_ids: list[int], markup: dict[int, str], tokenizer: Any) -> HarmonyParser:
    """A harmony parser in the state the prompt leaves it: the chat template ends
    with `<|start|>assistant`, so the answer begins inside a header."""
    parser = HarmonyParser()
    start = max((i for i, t in enumerate(prompt_ids) if markup.get(t) == "<|start|>"), default=-1)
    if start < 0:
        return parser
    run: list[int] = []
    for tid in prompt_ids[start:]:
        if tid in markup:
            if run:
                parser.text(tokenizer.decode(run))
                run = []
            parser.special(markup[tid])
        else:
            run.append(tid)
    if run:
        parser.text(tokenizer.decode(run))
    return parser


__all__ = ["ChatStream", "Piece", "ParsedCall", "open_stream"]

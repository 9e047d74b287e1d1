"""Message text is text: what a user, a tool or a document says is tokenized
without matching the tokenizer's added tokens, so typing `<|im_start|>` or
`<|start|>` never forges a control token. Only the template's own markup does.

A chat template is rendered with every added token's text in the request
broken by a marker character absent from the request; the rendered string is
then cut at the added tokens that remain (the template's markup), and each run
between them, its markers removed, is encoded as plain text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# Private-use characters: no template writes them, and one absent from the
# request is always found (the request would need all 6,400 to rule them out).
_MARKERS = range(0xE000, 0xF900)


class TextEncoder:
    """A tokenizer's plain-text encoding beside its markup tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # content -> (id, lstrip, rstrip): how the tokenizer itself matches them
        self.added: dict[str, tuple[int, bool, bool]] = {
            str(t.content): (int(i), bool(t.lstrip), bool(t.rstrip))
            for i, t in added.items()
            if str(getattr(t, "content", ""))
        }
        names = sorted(self.added, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self.plain = _without_added(tokenizer)

    def encode(self, text: str) -> list[int]:
        """`text` as the tokenizer encodes text that holds no added token: every
        `<|...|>` in it is plain characters."""
        if not text:
            return []
        if self.plain is not None:
            return list(self.plain.encode(text, add_special_tokens=False).ids)
        if self.pattern is None or not self.pattern.search(text):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        # No backend to bypass the added tokens: split them into characters.
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        return list(ids)

    def marker(self, *values: Any) -> str:
        """A character that no string in `values` holds, raw or JSON-escaped."""
        texts = list(_strings(values))
        for code in _MARKERS:
            ch, esc = chr(code), f"\\u{code:04x}"
            if not any(ch in t or esc in t.lower() for t in texts):
                return ch
        raise ValueError("the request uses every private-use character")

    def escape(self, value: Any, marker: str) -> Any:
        """`value` (messages, tools: dicts, lists, strings) with every added
        token's text in its strings broken by `marker`."""
        if isinstance(value, str):
            return self._break(value, marker)
        if isinstance(value, dict):
            return {k: self.escape(v, marker) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v, marker) for v in value]
        return value

    def _break(self, text: str, marker: str) -> str:
        if self.pattern is None:
            return text
        while (found := self.pattern.search(text)) is not None:
            at = found.start() + 1  # after its first character: no added token matches now
            text = text[:at] + marker + text[at:]
        return text

    def markup_ids(self, rendered: str, marker: str) -> list[int]:
        """A rendered template as ids: added tokens where the template wrote them,
        the runs between them as plain text with the markers taken out."""
        esc = f"\\u{ord(marker):04x}"
        ids: list[int] = []
        pos = 0
        strip_next = False
        for found in self.pattern.finditer(rendered) if self.pattern else ():
            tid, lstrip, rstrip = self.added[found.group()]
            run = rendered[pos : found.start()]
            run = run.lstrip() if strip_next else run
            run = run.rstrip() if lstrip else run
            ids += self.encode(run.replace(marker, "").replace(esc, ""))
            ids.append(tid)
            pos, strip_next = found.end(), rstrip
        tail = rendered[pos:]
        tail = tail.lstrip() if strip_next else tail
        return ids + self.encode(tail.replace(marker, "").replace(esc, ""))


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _without_added(tokenizer: Any) -> Any:
    """The tokenizer's normalizer, pre-tokenizer and model with no added tokens:
    what encodes the text between them (None without a `tokenizers` backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    plain = Tokenizer(backend.model)
    plain.normalizer = backend.normalizer
    plain.pre_tokenizer = backend.pre_tokenizer
    return plain


_ENCODERS: dict[int, tuple[Any, TextEncoder]] = {}


def text_encoder(tokenizer: Any) -> TextEncoder:
    """The tokenizer's `TextEncoder`, built once (a process holds a few tokenizers)."""
    hit = _ENCODERS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    if len(_ENCODERS) > 32:
        _ENCODERS.clear()
    enc = TextEncoder(tokenizer)
    _ENCODERS[id(tokenizer)] = (tokenizer, enc)
    return enc

"""Stop sequences, matched on text as tokens arrive.

Each piece is searched only where a new match can be: the held-back tail (at
most the longest stop minus one character) plus the piece itself. So a request's
whole text costs O(text × stops), not O(text² × stops) as rescanning would.
"""

from __future__ import annotations


class StopMatcher:
    """Holds back text that could still become a stop sequence."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.text = ""
        self.sent = 0  # characters of `text` already released
        self.hit = False
        self.matched: str | None = None  # the stop sequence that ended the text

    def feed(self, piece: str) -> str:
        """Add a piece; return the text now safe to show (never part of a stop)."""
        if self.hit:
            return ""
        start = max(0, len(self.text) - self.hold)  # no stop began before this
        self.text += piece
        ats = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if ats:
            at, self.matched = min(ats)
            self.text, self.hit = self.text[:at], True
            return self._emit(len(self.text))
        return self._emit(max(self.sent, len(self.text) - self.hold))

    def flush(self) -> str:
        """The request ended without a stop: release what was held back."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out

"""Peer-supplied text made safe for one log line."""

from __future__ import annotations

# Peer text (ERROR messages, bad JSON) in logs and messages is cut to this.
PEER_TEXT_MAX = 200


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object, limit: int | None = PEER_TEXT_MAX) -> str:
    """Peer-supplied text made safe for one log line: control characters shown
    as escapes (\\x1b, \\n), never interpreted; at most `limit` characters."""
    raw = str(text)
    head = raw if limit is None else raw[:limit]
    out = "".join(
        _ESCAPES.get(c)
        or (c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        for c in head
    )
    if limit is not None and (len(out) > limit or len(raw) > limit):
        return out[:limit] + "..."
    return out

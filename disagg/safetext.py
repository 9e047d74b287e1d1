"""Remote text made safe for a terminal: what hosts and agents say never drives it."""

from __future__ import annotations

import re

from disagg_agents.wire.text import printable

# Terminal escape sequences: CSI (colours, cursor, clear screen), OSC (titles,
# hyperlinks, clipboard) and the two-byte rest; whatever control byte is left is
# shown escaped by `printable`.
_TERMINAL_ESCAPE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x9b[0-?]*[ -/]*[@-~]"  # CSI, 7- and 8-bit
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC, to BEL or ST
    r"|\x1b[@-Z\\-_]"  # the other two-byte sequences
)


def strip_escapes(line: str) -> str:
    """A log line as plain text: terminal escapes removed, other control characters
    shown escaped, so printing it cannot drive the operator's terminal."""
    return printable(_TERMINAL_ESCAPE.sub("", line), limit=None)

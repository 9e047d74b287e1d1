"""The one path from a remote string to the terminal.

What agents, hosts and their logs say (status fields, stderr tails, ERROR
messages) becomes a rich `Text`: never parsed as markup (a `[link=...]` stays
brackets, a stray `[/]` cannot crash the render), terminal escapes removed and
other control characters shown escaped, lines kept where asked.
"""

from __future__ import annotations

from rich.text import Text

from disagg.safetext import strip_escapes
from disagg_agents.wire.text import printable

LIMIT = 300  # characters of one remote value in a table cell


def plain(value: object, limit: int | None = LIMIT, style: str = "") -> Text:
    """One remote value as one line of plain text."""
    return Text(printable(strip_escapes(str(value)), limit), style=style)


def plain_lines(value: object, limit: int | None = LIMIT, style: str = "") -> Text:
    """A remote value of several lines (a log tail), each line made plain."""
    lines = [printable(strip_escapes(line), limit) for line in str(value).splitlines()]
    return Text("\n".join(lines), style=style)

"""An agent's log: one line per record, whatever a peer put in it, to stderr or a
file rotated by size."""

from __future__ import annotations

import logging
import logging.handlers
import sys

from disagg_agents.runtime.metrics import LAST_ERROR
from disagg_agents.wire.text import printable

LOG_LINE_MAX = 4000  # characters of one log message; peer text is cut far shorter
LOG_MAX_BYTES = 16 << 20  # --log-file rotates at this size, keeping LOG_BACKUPS old files
LOG_BACKUPS = 3


class OneLineFormatter(logging.Formatter):
    """Every record's message on one line, control characters shown escaped
    (`\\x1b`, `\\n`): nothing a peer says can forge a line or drive a terminal.
    Tracebacks keep their own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message, LOG_LINE_MAX)
        return super().formatMessage(record)


def setup_logging(role: str, log_file: str | None = None, max_bytes: int = LOG_MAX_BYTES) -> None:
    """Log to stderr, or to `log_file` rotated at `max_bytes` (LOG_BACKUPS kept)."""
    handler: logging.Handler
    if log_file:
        handler = logging.handlers.RotatingFileHandler(
            log_file, maxBytes=max_bytes, backupCount=LOG_BACKUPS
        )
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in root.handlers:
        if old is not LAST_ERROR:
            old.close()  # a second call (preflight, then start_agent) replaces the first
    root.handlers[:] = [handler, LAST_ERROR]
    root.setLevel(logging.INFO)


def rotating_handlers() -> list[logging.handlers.RotatingFileHandler]:
    """setup_logging's file handler (--log-file); an agent logging to stderr has none."""
    return [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.handlers.RotatingFileHandler)
    ]

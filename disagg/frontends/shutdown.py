"""How `disagg serve` stops: a first Ctrl-C (or SIGTERM) says how many requests it
drains, stops taking new ones and exits once they end or the drain deadline passes
(streams still running then are cut, their decoding stopped); a second Ctrl-C stops
at once, in one line, with exit status 130 and no traceback."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn

DRAIN_S = 30.0  # --drain-timeout's default
CUT_GRACE_S = 5  # after the deadline, for cut requests to end before uvicorn cancels them


@dataclass
class Drain:
    in_flight: Callable[[], int]  # requests admitted now (running or waiting)
    stop_now: Callable[[], None]  # the second Ctrl-C: stop the agents, remove temp files
    cut: Callable[[], None]  # the deadline passed: end every request at its next token
    deadline_s: float = DRAIN_S
    # The first signal: what else stops (e.g. restarting agents), said in the line.
    began: Callable[[], str] = lambda: ""


def _line(text: str) -> None:
    """Straight to fd 2: a signal handler may run while rich is mid-print."""
    os.write(2, (text + "\n").encode(errors="replace"))


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        # Requests still running at the deadline are cut (their streams end cleanly);
        # uvicorn cancels what is left some seconds later.
        config.timeout_graceful_shutdown = int(max(1.0, drain.deadline_s)) + CUT_GRACE_S
        super().__init__(config)
        self.drain = drain
        self.signalled: int | None = None  # the first signal that began the drain

    def _cut(self) -> None:
        """The deadline passed: cut every request at its next token. One whose next
        token is slower than CUT_GRACE_S is cancelled by uvicorn, whose traceback
        for it says nothing the draining line did not."""
        self.drain.cut()
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            n = self.drain.in_flight()
            _line(f"stopped at once{f', {n} request(s) cut' if n else ''}")
            logging.disable(logging.CRITICAL)  # the cut requests' lines: this one said it
            try:
                self.drain.stop_now()
            finally:
                os._exit(130)  # no unwinding: threads mid-request would print tracebacks
        if not self.should_exit:
            self.signalled = sig
            note = self.drain.began()
            n = self.drain.in_flight()
            timer = threading.Timer(self.drain.deadline_s, self._cut)
            timer.daemon = True
            timer.start()
            _line(
                f"draining {n} request(s) for up to {self.drain.deadline_s:g}s, taking no new "
                f"ones{'; ' + note if note else ''} (Ctrl-C again to stop now)"
            )
        super().handle_exit(sig, frame)

    def exit_as_signalled(self) -> None:
        """After a drain that a signal began, leave as that signal does (Ctrl-C: 130).
        uvicorn raises the signal again once it has shut down, but a SIGINT then meets
        asyncio's own handler, which only cancels the main task, and the interrupt can
        be lost (once in CI: a drained `disagg serve` exited 0, not 130)."""
        if self.signalled == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signalled is not None:
            raise SystemExit(128 + self.signalled)

"""The prefill device, handed to one forward pass at a time, fairly.

A plain lock wakes waiters in no set order, so a prompt could wait behind
ones that came long after it. Here each waiter holds a ticket: first come,
first served, except that a prompt with much less left to compute (a short
one, or a prefix-cache hit) may go ahead, which cuts mean TTFT (shortest
first minimises the summed waits). Each waiter is overtaken at most
`max_bypass` times, so nobody starves. The slot is held for the forward pass
only: nothing that waits on a socket runs under it.

A waiter whose requester hung up, or whose deadline passed, leaves the line
before it starts (`Dropped`): a burst of abandoned prompts would otherwise keep
the device busy for clients that are gone while a live one waits behind them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

MAX_BYPASS = 4  # times a waiter may be overtaken by shorter prompts
POLL_S = 0.2  # how often a waiter asks whether its requester is still there


class Dropped(Exception):
    """Work stopped for a requester that is not waiting any more: it hung up
    ("gone"), or its deadline passed ("deadline"), before or during its turn."""

    def __init__(self, reason: str, where: str) -> None:
        what = "the requester hung up" if reason == "gone" else "its deadline passed"
        super().__init__(f"{where}: {what}")
        self.reason = reason


def cost_class(tokens: int) -> int:
    """Prompts within 2x of each other are one class and keep their arrival
    order: jumping a near-equal prompt gains little TTFT and costs fairness."""
    return max(0, tokens).bit_length()


@dataclass
class Ticket:
    seq: int  # arrival order
    tokens: int  # positions left to compute (prompt minus the expected prefix hit)
    bypassed: int = 0  # times a later arrival was served first
    granted: bool = False


def pick(waiting: list[Ticket], max_bypass: int = MAX_BYPASS) -> int:
    """Index in `waiting` (arrival order) of the ticket to serve next.

    The oldest waiter has been overtaken at least as often as anyone (every
    overtaking passed it too), so checking it alone bounds everyone's wait."""
    if waiting[0].bypassed >= max_bypass:
        return 0
    return min(range(len(waiting)), key=lambda i: (cost_class(waiting[i].tokens), waiting[i].seq))


class FairQueue:
    """`with q.slot(tokens) as waited_s:` runs the block alone on the device."""

    def __init__(self, max_bypass: int = MAX_BYPASS) -> None:
        self.max_bypass = max_bypass
        self.cond = threading.Condition()
        self.waiting: list[Ticket] = []  # arrival order
        self.busy = False
        self.next_seq = 0
        self.served = 0
        self.overtakes = 0  # grants that went ahead of an older waiter
        self.dropped = {"gone": 0, "deadline": 0}  # waiters that left before their turn

    @contextmanager
    def slot(
        self,
        tokens: int,
        gone: Callable[[], bool] | None = None,
        deadline: float | None = None,
    ) -> Iterator[float]:
        """The device, alone, once it is this prompt's turn. `gone()` true (its
        requester hung up) or `deadline` (time.monotonic) passed before then:
        Dropped, and the slot goes to the next waiter."""
        t0 = time.perf_counter()
        self._acquire(tokens, gone, deadline)
        try:
            yield time.perf_counter() - t0
        finally:
            self._release()

    def _acquire(
        self, tokens: int, gone: Callable[[], bool] | None, deadline: float | None
    ) -> None:
        t0 = time.perf_counter()
        with self.cond:
            ticket = Ticket(self.next_seq, tokens)
            self.next_seq += 1
            if not self.busy and not self.waiting:
                self.busy = True
                why = _left(gone, deadline)  # checked once: it starts now
                if why is not None:
                    self._grant_next()
                    self._drop(why, t0)
                return
            self.waiting.append(ticket)
            poll = POLL_S if gone is not None or deadline is not None else None
            try:
                while not ticket.granted:
                    why = _left(gone, deadline)
                    if why is not None:
                        self._drop(why, t0)
                    self.cond.wait(poll)
                why = _left(gone, deadline)  # granted: the last look before it starts
                if why is not None:
                    self._drop(why, t0)
            except BaseException:
                # Interrupted or dropped: give back a slot granted meanwhile.
                if ticket.granted:
                    self._grant_next()
                else:
                    self.waiting.remove(ticket)
                raise

    def _drop(self, why: str, t0: float) -> NoReturn:
        """Called with `cond` held: count it and leave the line."""
        self.dropped[why] += 1
        waited_s = time.perf_counter() - t0
        raise Dropped(why, f"dropped from the prefill queue after {waited_s:.1f}s")

    def _release(self) -> None:
        with self.cond:
            self.served += 1
            self._grant_next()

    def _grant_next(self) -> None:
        """Hand the slot on (or free it); called with `cond` held."""
        if not self.waiting:
            self.busy = False
            return
        i = pick(self.waiting, self.max_bypass)
        for older in self.waiting[:i]:
            older.bypassed += 1
        self.overtakes += i > 0
        self.waiting.pop(i).granted = True  # `busy` stays set: it passes straight on
        self.cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """For /status: who waits for the device now."""
        with self.cond:
            return {
                "busy": self.busy,
                "waiting": len(self.waiting),
                "waiting_tokens": sum(t.tokens for t in self.waiting),
                "served": self.served,
                "overtakes": self.overtakes,
                "dropped_gone": self.dropped["gone"],
                "dropped_deadline": self.dropped["deadline"],
            }


def _left(gone: Callable[[], bool] | None, deadline: float | None) -> str | None:
    """Why a waiter should leave now ("gone", "deadline"), or None to stay."""
    if deadline is not None and time.monotonic() >= deadline:
        return "deadline"
    if gone is not None and gone():
        return "gone"
    return None

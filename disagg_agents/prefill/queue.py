"""The prefill device, handed to one forward pass at a time, fairly.

A plain lock wakes waiters in no set order, so a prompt could wait behind
ones that came long after it. Here each waiter holds a ticket: first come,
first served, except that a prompt with much less left to compute (a short
one, or a prefix-cache hit) may go ahead, which cuts mean TTFT (shortest
first minimises the summed waits). Each waiter is overtaken at most
`max_bypass` times, so nobody starves. The slot is held for the forward pass
only: nothing that waits on a socket runs under it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

MAX_BYPASS = 4  # times a waiter may be overtaken by shorter prompts


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

    @contextmanager
    def slot(self, tokens: int) -> Iterator[float]:
        t0 = time.perf_counter()
        self._acquire(tokens)
        try:
            yield time.perf_counter() - t0
        finally:
            self._release()

    def _acquire(self, tokens: int) -> None:
        with self.cond:
            ticket = Ticket(self.next_seq, tokens)
            self.next_seq += 1
            if not self.busy and not self.waiting:
                self.busy = True
                return
            self.waiting.append(ticket)
            try:
                while not ticket.granted:
                    self.cond.wait()
            except BaseException:
                # Interrupted while waiting: give back a slot granted meanwhile.
                if ticket.granted:
                    self._grant_next()
                else:
                    self.waiting.remove(ticket)
                raise

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
            }

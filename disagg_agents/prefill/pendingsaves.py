"""Prefix-cache saves that wait for their turn without holding anyone up.

A finished prompt's blocks are copied into the cache after its K/V and logits
are sent (copying first would delay its first token). The next prompt must
still find them, else it misses the prefix the previous one just computed. A
lock held until that send ended made every prompt wait on the slowest peer's
socket; instead the next lookup runs any pending save itself (a memory copy,
no I/O), and the owner's own call later finds nothing left to do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("disagg.prefix")


class _Job:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn  # None once run (drops the K/V it holds)
        self.lock = threading.Lock()  # a second caller waits for the copy to end


class PendingSaves:
    """Stores in arrival order, each run exactly once by whoever comes first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: list[_Job] = []

    def add(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Queue `fn`; returns the owner's call, to make once its sends are done."""
        job = _Job(fn)
        with self.lock:
            self.jobs.append(job)
        return lambda: self._run(job)

    def flush(self) -> None:
        """Run every pending save now (before a lookup that should see them)."""
        with self.lock:
            jobs = list(self.jobs)
        for job in jobs:
            try:
                self._run(job)
            except Exception:  # the owner's request failed it; the lookup goes on
                log.exception("prefix cache save failed")

    def __len__(self) -> int:
        with self.lock:
            return len(self.jobs)

    def _run(self, job: _Job) -> None:
        with job.lock:
            fn, job.fn = job.fn, None
            if fn is None:
                return
            try:
                fn()
            finally:
                with self.lock:
                    self.jobs.remove(job)

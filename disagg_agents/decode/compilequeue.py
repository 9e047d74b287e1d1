"""The grammar compiles of one model: a few worker threads, shared fairly by tenants.

A job is one grammar of one tenant; requests that ask for the same one at the same
time wait for the same job. Each job has a deadline (the latest of its waiters');
a job nobody waits for any more, or whose deadline passed, is dropped before it
starts. Tenants take turns, and one tenant runs at most `per_tenant` compiles at
once: one caller's flood of slow schemas leaves a worker for everyone else.

No lock is held while a job runs or while its `finished` callback runs: the
callback may take any lock of its own (one that did, inside a future's cancel,
once deadlocked every later compile).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("disagg.decode")

QUEUED, RUNNING, DONE, DROPPED = "queued", "running", "done", "dropped"


class Expired(Exception):
    """A job's deadline passed before a worker was free to start it."""


@dataclass(eq=False)
class Job:
    """One compile and the requests waiting for it."""

    key: Hashable
    tenant: str
    run: Callable[[float], Any]  # given the job's deadline (time.monotonic)
    deadline: float
    waiting: int = 0
    state: str = QUEUED
    result: Any = None
    error: BaseException | None = None
    kept: bool = False  # someone still waited when it ended (worth caching)
    done: threading.Event = field(default_factory=threading.Event)


class CompileQueue:
    """`join` a job (new or already queued), wait on `job.done`, `leave` it."""

    def __init__(
        self,
        workers: int,
        per_tenant: int,
        finished: Callable[[Job], None] = lambda job: None,
        name: str = "grammar",
    ) -> None:
        self.workers = workers
        self.per_tenant = max(1, per_tenant)
        self.finished = finished  # called on a worker thread, no lock held
        self.name = name
        self._cond = threading.Condition()
        self._jobs: dict[Hashable, Job] = {}  # queued or running, by key
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # per tenant, in turn
        self._running: dict[str, int] = {}
        self._threads: list[threading.Thread] = []

    def join(
        self, key: Hashable, tenant: str, run: Callable[[float], Any], deadline: float
    ) -> tuple[Job, bool]:
        """The job for `key` (True: made now), with one more waiter until `deadline`."""
        with self._cond:
            job = self._jobs.get(key)
            new = job is None
            if job is None:
                job = self._jobs[key] = Job(key, tenant, run, deadline)
                self._queues.setdefault(tenant, deque()).append(job)
                self._start_workers()
                self._cond.notify()
            job.waiting += 1
            job.deadline = max(job.deadline, deadline)
        return job, new

    def leave(self, job: Job) -> None:
        """One waiter gone (answered, timed out or hung up); the last one's leaving
        drops the job if it has not started."""
        with self._cond:
            job.waiting -= 1
            if job.waiting > 0 or job.state != QUEUED:
                return
            job.state = DROPPED
            self._jobs.pop(job.key, None)
            self._cond.notify_all()
        job.done.set()

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            running = sum(self._running.values())
            return {"compiling": running, "queued": len(self._jobs) - running}

    def _start_workers(self) -> None:
        """On the first job (called with the lock held): the workers, for good."""
        while len(self._threads) < self.workers:
            t = threading.Thread(
                target=self._work, daemon=True, name=f"{self.name}-{len(self._threads)}"
            )
            self._threads.append(t)
            t.start()

    def _work(self) -> None:
        while True:
            job = self._next()
            try:
                job.result = job.run(job.deadline)
            except Exception as e:  # the waiters raise it; the worker goes on
                job.error = e
            self._end(job)

    def _next(self) -> Job:
        """The next job to run: the first tenant in turn that is under its share
        and has a live job."""
        with self._cond:
            while True:
                job = self._pick()
                if job is not None:
                    return job
                self._cond.wait()

    def _pick(self) -> Job | None:
        """Called with the lock held. Jobs past their deadline are ended on the way
        (waking their waiters runs nothing of theirs: they poll an Event)."""
        now = time.monotonic()
        for tenant in list(self._queues):
            queue = self._queues[tenant]
            if self._running.get(tenant, 0) >= self.per_tenant:
                continue
            while queue:
                job = queue.popleft()
                if job.state != QUEUED:
                    continue  # dropped by its last waiter
                if job.deadline <= now:
                    job.state, job.error = DROPPED, Expired()
                    self._jobs.pop(job.key, None)
                    job.done.set()
                    continue
                job.state = RUNNING
                self._running[tenant] = self._running.get(tenant, 0) + 1
                self._queues.move_to_end(tenant)  # the others go first next time
                if not queue:
                    del self._queues[tenant]
                return job
            del self._queues[tenant]
        return None

    def _end(self, job: Job) -> None:
        """Outside the lock: the callback (it may cache the result), then the job
        is no longer joinable, then its waiters wake."""
        with self._cond:
            job.kept = job.waiting > 0
        try:
            self.finished(job)
        except Exception:  # the waiters still get the job's own result
            log.exception("after a grammar compile")
        finally:
            with self._cond:
                self._running[job.tenant] -= 1
                if not self._running[job.tenant]:
                    del self._running[job.tenant]
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                job.state = DONE
                self._cond.notify_all()  # the tenant is under its share again
            job.done.set()

"""The gateway's request threads and its admission limit.

A request holds a thread while it runs (the router is blocking code). Python's
default pool has min(32, cores + 4) threads: a fast request waited behind a few
slow ones while the decode agents had free batch slots. Here the pool is sized to
the cluster's batch capacity (the decode agents' max_batch, from /status), and at
most `limit` requests are admitted at once (running, or waiting for a thread);
one more is refused at once with Overloaded, which the gateway answers 429
(OpenAI) or 503 (Ollama) with Retry-After, instead of queueing without end.

With two keys or more, each key (tenant) may hold at most `per_key` of those:
by default KEY_SHARE of the worker threads (which are the cluster's batch rows),
or of the admission limit if that is smaller. Derived from the threads, not the
limit: at the defaults both the limit's half and the pool were 32, so one key
with 50 streams held every thread and every batch row, and another key's 4-token
chat waited 21 s. A request waiting for a thread is started fairly: the waiting
request of the key that runs the fewest goes first, not the oldest. The tenant
comes from the guard (disagg.frontends.tenancy), and rides along onto the worker
thread with the request's context.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from disagg.errors import Overloaded
from disagg.frontends import tenancy
from disagg.serving.control import agent_status
from disagg.serving.router import Router
from disagg_agents.wire.frames import PeerAuthError

DEFAULT_BATCH = 32  # a decode agent's --max-batch default, for one that does not answer
QUEUE_FACTOR = 2  # admitted requests per worker by default: a burst waits, a flood is refused
RETRY_AFTER_S = 1
KEY_SHARE = 0.5  # of the workers (batch rows) one key may hold, with two keys or more

log = logging.getLogger("disagg.gateway")

Ps = ParamSpec("Ps")
T = TypeVar("T")


def batch_capacity(router: Router, timeout_s: float = 2.0) -> int:
    """Requests the cluster decodes at once: the sum of its decode agents' max_batch."""
    total = 0
    for pipe in router.pipelines.values():
        for ep in pipe.decode:
            size = DEFAULT_BATCH
            if ep.control_port is not None:
                try:
                    got = agent_status(ep.host, ep.control_port, router.token, timeout_s)
                    if got.max_batch is not None and got.max_batch > 0:
                        size = got.max_batch
                except (OSError, ValueError, PeerAuthError):
                    pass  # down for now: count what it would take
            total += size
    return max(total, 1)


def key_share(size: int, limit: int, share: float = KEY_SHARE) -> int:
    """One key's default share: `share` of the threads (or of the limit, if fewer)."""
    return max(1, math.floor(min(size, limit) * share))


class Workers(Executor):
    """`size` threads; `submit` raises Overloaded when `limit` requests are in, or
    when the caller's tenant holds `per_key` of them already."""

    def __init__(self, size: int, limit: int | None = None, per_key: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"workers must be at least 1, got {size}")
        self.size = size
        self.limit = QUEUE_FACTOR * size if limit is None else limit
        if self.limit < 1:
            raise ValueError(f"the admission limit must be at least 1, got {self.limit}")
        self.per_key = self.limit if per_key is None else min(per_key, self.limit)
        if self.per_key < 1:
            raise ValueError(f"the per-key limit must be at least 1, got {self.per_key}")
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="gateway")
        self.lock = threading.Lock()
        self.admitted = 0  # running or waiting for a thread
        self.held: dict[bytes | None, int] = {}  # admitted, per tenant
        self.running: dict[bytes | None, int] = {}  # on a thread now, per tenant
        self.waiting: dict[bytes | None, deque[_Waiting]] = {}  # for a thread, per tenant
        self.refused = 0

    @classmethod
    def for_router(
        cls,
        router: Router,
        size: int | None = None,
        limit: int | None = None,
        per_key: int | None = None,
        keys: int = 0,
    ) -> Workers:
        """Sized to the cluster; with `keys` >= 2 and no `per_key`, each key's share
        is KEY_SHARE of the limit."""
        size = size or batch_capacity(router)
        if per_key is None and keys >= 2:
            per_key = key_share(size, limit or QUEUE_FACTOR * size)
        workers = cls(size, limit, per_key)
        log.info(
            "%d workers, at most %d requests admitted, %d per key",
            workers.size,
            workers.limit,
            workers.per_key,
        )
        return workers

    def submit(self, fn: Callable[Ps, T], /, *args: Ps.args, **kwargs: Ps.kwargs) -> Future[T]:
        tenant = tenancy.current()
        with self.lock:
            held = self.held.get(tenant, 0)
            if self.admitted >= self.limit or held >= self.per_key:
                self.refused += 1
                mine = held >= self.per_key and self.admitted < self.limit
                raise Overloaded(
                    f"this API key holds its share of {self.per_key} requests: "
                    f"retry in {RETRY_AFTER_S}s"
                    if mine
                    else f"the gateway is serving its limit of {self.limit} requests: "
                    f"retry in {RETRY_AFTER_S}s",
                    RETRY_AFTER_S,
                )
            self.admitted += 1
            self.held[tenant] = held + 1
        # The request's context (its tenant) goes with it onto the worker thread.
        context = contextvars.copy_context()
        job = _Waiting(Future(), functools.partial(context.run, fn, *args, **kwargs))
        with self.lock:
            self.waiting.setdefault(tenant, deque()).append(job)
            start = self._next()
        job.future.add_done_callback(
            lambda f: self._cancelled(tenant, job) if f.cancelled() else None
        )
        self._start(start)
        return job.future

    def _next(self) -> tuple[bytes | None, _Waiting] | None:
        """Under the lock: the waiting request to start on a free thread, if one is
        free: the one of the key running the fewest (then the longest waiting)."""
        if sum(self.running.values()) >= self.size or not self.waiting:
            return None
        tenant = min(self.waiting, key=lambda t: (self.running.get(t, 0), self.waiting[t][0].at))
        queue = self.waiting[tenant]
        job = queue.popleft()
        if not queue:
            del self.waiting[tenant]
        self.running[tenant] = self.running.get(tenant, 0) + 1
        return tenant, job

    def _start(self, start: tuple[bytes | None, _Waiting] | None) -> None:
        while start is not None:
            tenant, job = start
            if not job.future.set_running_or_notify_cancel():  # cancelled while it waited
                start = self._finished(tenant)
                continue
            try:
                self.pool.submit(self._run, tenant, job)
                return
            except BaseException as e:  # the pool shut down
                job.future.set_exception(e)
                start = self._finished(tenant)

    def _run(self, tenant: bytes | None, job: _Waiting) -> None:
        try:
            result, error = job.call(), None
        except BaseException as e:
            result, error = None, e
        # The share comes back before the caller hears: it may send its next at once.
        self._start(self._finished(tenant))
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _cancelled(self, tenant: bytes | None, job: _Waiting) -> None:
        """A waiting request given up (its client left): its share back now."""
        with self.lock:
            queue = self.waiting.get(tenant)
            if queue is None or job not in queue:
                return  # already taken off the queue: _start releases it
            queue.remove(job)
            if not queue:
                del self.waiting[tenant]
            self.running[tenant] = self.running.get(tenant, 0) + 1  # as _finished expects
        self._start(self._finished(tenant))

    def _finished(self, tenant: bytes | None) -> tuple[bytes | None, _Waiting] | None:
        """A request left its thread (or never got one): its share back, and the next."""
        with self.lock:
            self.admitted -= 1
            for table in (self.held, self.running):
                left = table.get(tenant, 0) - 1
                if left > 0:
                    table[tenant] = left
                else:
                    table.pop(tenant, None)
            return self._next()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            with self.lock:
                waiting, self.waiting = self.waiting, {}
            for queue in waiting.values():
                for job in queue:
                    job.future.cancel()
        self.pool.shutdown(wait, cancel_futures=cancel_futures)


@dataclass(eq=False)
class _Waiting:
    """An admitted request waiting for a thread: its future and its call."""

    future: Future[Any]
    call: Callable[[], Any]
    at: float = field(default_factory=time.monotonic)

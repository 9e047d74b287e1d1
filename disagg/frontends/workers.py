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

A key's share counts prompt tokens too, not only requests: 14 chats of ~1,550
tokens each were inside one key's share of requests, and held the prefill agent
for minutes while another key's chat waited. Each request carries a Charge, its
prompt's tokens (estimated from its text), held from admission until its first
token (or its end); a key holding `per_key_tokens` of them is refused more (429),
except its first request, however long: one prompt may always run.
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
# Prompt tokens one key may have waiting for their first token, with two keys or more:
# ~10 long chats; at a prefill agent's few thousand tokens a second, seconds of its time.
KEY_PROMPT_TOKENS = 16384
BYTES_PER_TOKEN = 4  # a prompt's tokens guessed from its UTF-8 bytes (English BPE: ~4)


@dataclass(eq=False)
class Charge:
    """One request's prompt tokens, held against its key's share until `settle`."""

    tokens: int
    tenant: bytes | None = None
    held: bool = False  # counted in its key's share now


_charge: contextvars.ContextVar[Charge | None] = contextvars.ContextVar(
    "disagg_charge", default=None
)


def charge(tokens: int) -> Charge:
    """The prompt tokens of the request submitted next from this context (a
    request's task): Workers.submit holds them against its key's share."""
    c = Charge(max(0, tokens))
    _charge.set(c)
    return c


def prompt_tokens(prompt_bytes: int) -> int:
    """A prompt's tokens, guessed from its bytes before any tokenizer sees it."""
    return prompt_bytes // BYTES_PER_TOKEN


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

    def __init__(
        self,
        size: int,
        limit: int | None = None,
        per_key: int | None = None,
        per_key_tokens: int | None = None,
    ) -> None:
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
        # Prompt tokens waiting for their first token, per tenant (None: no bound).
        self.per_key_tokens = per_key_tokens
        self.tokens: dict[bytes | None, int] = {}

    @classmethod
    def for_router(
        cls,
        router: Router,
        size: int | None = None,
        limit: int | None = None,
        per_key: int | None = None,
        keys: int = 0,
        per_key_tokens: int | None = None,
    ) -> Workers:
        """Sized to the cluster; with `keys` >= 2 and no `per_key`, each key's share
        is KEY_SHARE of the limit, and KEY_PROMPT_TOKENS of prompt tokens unless
        `per_key_tokens` says."""
        size = size or batch_capacity(router)
        if per_key is None and keys >= 2:
            per_key = key_share(size, limit or QUEUE_FACTOR * size)
        tokens = per_key_tokens or (KEY_PROMPT_TOKENS if keys >= 2 else None)
        workers = cls(size, limit, per_key, tokens)
        log.info(
            "%d workers, at most %d requests admitted, %d per key",
            workers.size,
            workers.limit,
            workers.per_key,
        )
        return workers

    def submit(self, fn: Callable[Ps, T], /, *args: Ps.args, **kwargs: Ps.kwargs) -> Future[T]:
        tenant = tenancy.current()
        cost = _charge.get()
        with self.lock:
            why = self._refusal(tenant, cost)
            if why is not None:
                self.refused += 1
                raise Overloaded(f"{why}: retry in {RETRY_AFTER_S}s", RETRY_AFTER_S)
            self.admitted += 1
            self.held[tenant] = self.held.get(tenant, 0) + 1
            if cost is not None and not cost.held:
                cost.tenant, cost.held = tenant, True
                self.tokens[tenant] = self.tokens.get(tenant, 0) + cost.tokens
        # The request's context (its tenant) goes with it onto the worker thread.
        context = contextvars.copy_context()
        call = functools.partial(context.run, fn, *args, **kwargs)
        job = _Waiting(Future(), call, cost)
        with self.lock:
            self.waiting.setdefault(tenant, deque()).append(job)
            start = self._next()
        job.future.add_done_callback(
            lambda f: self._cancelled(tenant, job) if f.cancelled() else None
        )
        self._start(start)
        return job.future

    def _refusal(self, tenant: bytes | None, cost: Charge | None) -> str | None:
        """Under the lock: why a request of `tenant` costing `cost` is refused now."""
        held = self.held.get(tenant, 0)
        if self.admitted >= self.limit:
            return f"the gateway is serving its limit of {self.limit} requests"
        if held >= self.per_key:
            return f"this API key holds its share of {self.per_key} requests"
        queued, cap = self.tokens.get(tenant, 0), self.per_key_tokens
        if cost is not None and cap is not None and queued and queued + cost.tokens > cap:
            return (
                f"this API key has {queued} prompt tokens waiting to be prefilled, and this "
                f"prompt's ~{cost.tokens} would pass its share of {cap}"
            )
        return None

    def settle(self, cost: Charge) -> None:
        """`cost`'s prompt is prefilled (its first token is out) or it ended: its
        tokens leave its key's share. Safe to call twice."""
        with self.lock:
            if not cost.held:
                return
            cost.held = False
            left = self.tokens.get(cost.tenant, 0) - cost.tokens
            if left > 0:
                self.tokens[cost.tenant] = left
            else:
                self.tokens.pop(cost.tenant, None)

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
                start = self._finished(tenant, job)
                continue
            try:
                self.pool.submit(self._run, tenant, job)
                return
            except BaseException as e:  # the pool shut down
                job.future.set_exception(e)
                start = self._finished(tenant, job)

    def _run(self, tenant: bytes | None, job: _Waiting) -> None:
        try:
            result, error = job.call(), None
        except BaseException as e:
            result, error = None, e
        # The share comes back before the caller hears: it may send its next at once.
        self._start(self._finished(tenant, job))
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
        self._start(self._finished(tenant, job))

    def _finished(
        self, tenant: bytes | None, job: _Waiting
    ) -> tuple[bytes | None, _Waiting] | None:
        """A request left its thread (or never got one): its share back, and the next."""
        if job.cost is not None:
            self.settle(job.cost)
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
    cost: Charge | None = None  # its prompt tokens, held against its key's share
    at: float = field(default_factory=time.monotonic)

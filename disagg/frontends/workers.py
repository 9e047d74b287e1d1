"""The gateway's request threads and its admission limit.

A request holds a thread while it runs (the router is blocking code). Python's
default pool has min(32, cores + 4) threads: a fast request waited behind a few
slow ones while the decode agents had free batch slots. Here the pool is sized to
the cluster's batch capacity (the decode agents' max_batch, from /status), and at
most `limit` requests are admitted at once (running, or waiting for a thread);
one more is refused at once with Overloaded, which the gateway answers 429
(OpenAI) or 503 (Ollama) with Retry-After, instead of queueing without end.

With two keys or more, each key (tenant) may hold at most `per_key` of those
(default half, KEY_SHARE): two streams of one tenant once held a limit of 2 and
every other tenant got 429. The tenant comes from the guard (disagg.frontends.
tenancy), and rides along onto the worker thread with the request's context.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from disagg.errors import Overloaded
from disagg.frontends import tenancy
from disagg.serving.control import control_status
from disagg.serving.router import Router
from disagg_agents.wire.frames import AuthError

DEFAULT_BATCH = 32  # a decode agent's --max-batch default, for one that does not answer
QUEUE_FACTOR = 2  # admitted requests per worker by default: a burst waits, a flood is refused
RETRY_AFTER_S = 1
KEY_SHARE = 0.5  # of the admission limit one key may hold, when there are two keys or more

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
                    got = control_status(ep.host, ep.control_port, router.token, timeout_s)
                    if isinstance(got.get("max_batch"), int) and got["max_batch"] > 0:
                        size = got["max_batch"]
                except (OSError, ValueError, AuthError):
                    pass  # down for now: count what it would take
            total += size
    return max(total, 1)


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
            per_key = max(1, math.floor((limit or QUEUE_FACTOR * size) * KEY_SHARE))
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
        release = functools.partial(self._release, tenant)
        try:
            fut = self.pool.submit(context.run, functools.partial(fn, *args, **kwargs))
        except BaseException:
            release()
            raise
        fut.add_done_callback(release)
        return fut

    def _release(self, tenant: bytes | None, _: Any = None) -> None:
        with self.lock:
            self.admitted -= 1
            left = self.held.get(tenant, 0) - 1
            if left > 0:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait, cancel_futures=cancel_futures)

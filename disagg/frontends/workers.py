"""The gateway's request threads and its admission limit.

A request holds a thread while it runs (the router is blocking code). Python's
default pool has min(32, cores + 4) threads: a fast request waited behind a few
slow ones while the decode agents had free batch slots. Here the pool is sized to
the cluster's batch capacity (the decode agents' max_batch, from /status), and at
most `limit` requests are admitted at once (running, or waiting for a thread);
one more is refused at once with Overloaded, which the gateway answers 429
(OpenAI) or 503 (Ollama) with Retry-After, instead of queueing without end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from agents.wire.frames import AuthError
from disagg.errors import Overloaded
from disagg.serving.control import control_status
from disagg.serving.router import Router

DEFAULT_BATCH = 32  # a decode agent's --max-batch default, for one that does not answer
QUEUE_FACTOR = 2  # admitted requests per worker by default: a burst waits, a flood is refused
RETRY_AFTER_S = 1

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
    """`size` threads; `submit` raises Overloaded when `limit` requests are in."""

    def __init__(self, size: int, limit: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"workers must be at least 1, got {size}")
        self.size = size
        self.limit = QUEUE_FACTOR * size if limit is None else limit
        if self.limit < 1:
            raise ValueError(f"the admission limit must be at least 1, got {self.limit}")
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="gateway")
        self.lock = threading.Lock()
        self.admitted = 0  # running or waiting for a thread
        self.refused = 0

    @classmethod
    def for_router(
        cls, router: Router, size: int | None = None, limit: int | None = None
    ) -> Workers:
        workers = cls(size or batch_capacity(router), limit)
        log.info("%d workers, at most %d requests admitted", workers.size, workers.limit)
        return workers

    def submit(self, fn: Callable[Ps, T], /, *args: Ps.args, **kwargs: Ps.kwargs) -> Future[T]:
        with self.lock:
            if self.admitted >= self.limit:
                self.refused += 1
                raise Overloaded(
                    f"the gateway is serving its limit of {self.limit} requests: "
                    f"retry in {RETRY_AFTER_S}s",
                    RETRY_AFTER_S,
                )
            self.admitted += 1
        try:
            fut = self.pool.submit(fn, *args, **kwargs)
        except BaseException:
            self._release()
            raise
        fut.add_done_callback(self._release)
        return fut

    def _release(self, _: Any = None) -> None:
        with self.lock:
            self.admitted -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait, cancel_futures=cancel_futures)

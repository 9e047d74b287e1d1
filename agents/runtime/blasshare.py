"""OpenBLAS threads for a decode agent that shares its cores with a prefill agent.

On one machine (a local pair, the test bed) torch's prefill and the decode
agent's OpenBLAS run on the same cores. A multi-threaded gemm waits for its
slowest thread, and a thread the prefill has pushed off its core stalls the
whole step: 16 streams beside a busy prefill ran 2x slower per token with two
threads than with one. Alone, the second thread is a 1.3x faster step. So while
a prefill for this agent runs, OpenBLAS gets `shared` threads, and all of them
otherwise. Whoever starts both agents on one machine says so with ENV
(disagg.serving.localagents); a decode agent on its own machine never shares.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from agents.runtime import fastblas

ENV = "DISAGG_BLAS_SHARED"  # threads while a prefill for this agent runs beside it

Post = Callable[..., Any]  # runs fn(*args) on the mlx thread, in order (DecodeLoop.post)


class BlasShare:
    def __init__(self, post: Post, shared: int | None, full: int | None) -> None:
        self.post = post
        # No sharing without a bound OpenBLAS, or when it has no more threads to give.
        on = shared is not None and full is not None and shared < full
        self.shared = shared if on else None
        self.full = full
        self.prefills = 0  # this agent's remote prefills now running
        self.lock = threading.Lock()

    @classmethod
    def from_env(cls, post: Post) -> BlasShare:
        value = os.environ.get(ENV, "")
        shared = int(value) if value.isdigit() and int(value) > 0 else None
        return cls(post, shared, fastblas.threads())

    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """Around one remote prefill: the first to start takes threads away, the
        last to end gives them back (set on the mlx thread, between steps)."""
        if self.shared is None:
            yield
            return
        with self.lock:  # posted under the lock: the mlx thread applies them in order
            self.prefills += 1
            if self.prefills == 1:
                self.post(fastblas.set_threads, self.shared)
        try:
            yield
        finally:
            with self.lock:
                self.prefills -= 1
                if self.prefills == 0:
                    self.post(fastblas.set_threads, self.full)

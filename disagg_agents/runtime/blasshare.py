"""OpenBLAS threads for a decode agent that shares its cores with a prefill agent.

On one machine (a local pair, the test bed) torch's prefill and the decode
agent's OpenBLAS run on the same cores. A multi-threaded gemm waits for its
slowest thread, and a thread the prefill has pushed off its core stalls the
whole step: 16 streams beside a busy prefill ran 2x slower per token with two
threads than with one. Alone, the second thread is a 1.3x faster step. So while
a prefill for this agent runs, OpenBLAS gets `shared` threads, and all of them
otherwise. Whoever starts both agents on one machine says so with ENV
(disagg.serving.localagents); a decode agent on its own machine never shares.

Other work on the machine is the same problem from outside: beside two busy
processes on 2 cores, two spinning OpenBLAS threads decoded 10-30x slower than
one. So between steps the agent looks how many cores others want now
(disagg_agents/runtime/cpubusy.py) and uses no more threads than they leave.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from disagg_agents.runtime import fastblas
from disagg_agents.runtime.cpubusy import FreeCores

ENV = "DISAGG_BLAS_SHARED"  # threads while a prefill for this agent runs beside it
WATCH_ENV = "DISAGG_BLAS_WATCH"  # "0": keep every thread however busy the machine is
SAMPLE_S = 0.05  # how often the machine's other work is looked at (~0.08 ms a look)

Post = Callable[..., Any]  # runs fn(*args) on the mlx thread, in order (DecodeLoop.post)


class BlasShare:
    """`shared`: threads while a prefill for this agent runs beside it (None: no
    sharing); `full`: the pool OpenBLAS started with (None: mlx's own BLAS);
    `free`: watches the machine's other work, so a busy machine gets fewer
    threads (None: no watching)."""

    def __init__(
        self, post: Post, shared: int | None, full: int | None, free: FreeCores | None = None
    ) -> None:
        self.post = post
        # No sharing without a bound OpenBLAS, or when it has no more threads to give.
        on = shared is not None and full is not None and shared < full
        self.shared = shared if on else None
        self.full = full
        self.free = free if full is not None and full > 1 else None
        self.spare = full  # threads the other work leaves us, as last sampled
        self.current = full  # what OpenBLAS uses now (set on the mlx thread only)
        self.limited_by: str | None = None  # why fewer than `full`: "prefill", "busy machine"
        self.sampled_at = 0.0
        self.prefills = 0  # this agent's remote prefills now running
        self.lock = threading.Lock()

    @classmethod
    def from_env(cls, post: Post) -> BlasShare:
        value = os.environ.get(ENV, "")
        shared = int(value) if value.isdigit() and int(value) > 0 else None
        watch = os.environ.get(WATCH_ENV, "1") != "0"
        return cls(post, shared, fastblas.threads(), FreeCores() if watch else None)

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
                self.post(self.apply)
        try:
            yield
        finally:
            with self.lock:
                self.prefills -= 1
                if self.prefills == 0:
                    self.post(self.apply)

    def tick(self) -> None:
        """Before a turn of mlx work (on the mlx thread): at most every SAMPLE_S,
        how many cores the machine's other work leaves, and the count to match."""
        if self.free is None:
            return
        now = time.monotonic()
        if now - self.sampled_at >= SAMPLE_S:
            self.sampled_at = now
            self.spare = self.free.sample() or self.full
            self.apply()

    def idle(self) -> None:
        """Nothing to run (mlx thread): every thread back; the next turn looks again."""
        self.spare, self.sampled_at = self.full, 0.0
        self.apply()

    def apply(self) -> None:
        """OpenBLAS's count for now: the share's cap, within what others leave (mlx thread)."""
        if self.full is None:
            return
        cap = self.shared if self.shared is not None and self.prefills > 0 else self.full
        want = max(1, min(cap, self.spare or cap))
        if want != self.current:
            fastblas.set_threads(want)
            self.current = want
        # What an operator reads in /status beside blas_threads: why not all of them.
        busy = self.spare is not None and self.spare < cap
        self.limited_by = None if want >= self.full else "busy machine" if busy else "prefill"

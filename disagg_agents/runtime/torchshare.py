"""torch threads for a prefill agent that shares its cores with a decode agent.

On one machine (a local pair) torch's prefill and the decode agent's gemms run on
the same cores. torch's OpenMP threads wait for each other at the end of every op,
so one pushed off its core by a decode step stalls the whole forward pass, and the
decode step waits for its core in turn: 16 grader streams on 2 cores decoded at
0.45 s per token beside a two-thread prefill and 0.40 s beside a one-thread one,
and their prefills finished sooner (docs/bench-history/2026-11-26-pm-torch-share.md). So a prefill
whose requester says it is decoding (PrefillRequest.cores_busy) runs on `shared`
threads; a prefill with nothing beside it gets every core. Whoever starts both
agents on one machine says so with ENV (disagg.serving.localagents); a prefill
agent on its own machine never shares.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "DISAGG_TORCH_SHARED"  # threads while the requester decodes beside this agent


class TorchShare:
    def __init__(self, shared: int | None, full: int) -> None:
        self.full = full
        self.shared = shared if shared is not None and shared < full else None

    @classmethod
    def from_env(cls) -> TorchShare:
        value = os.environ.get(ENV, "")
        shared = int(value) if value.isdigit() and int(value) > 0 else None
        return cls(shared, torch.get_num_threads())

    @contextmanager
    def threads(self, busy: bool) -> Iterator[int]:
        """Around one forward pass (one at a time per device: the FairQueue's
        slot): torch's thread count for it, yielded."""
        if self.shared is None or not busy:
            yield torch.get_num_threads()
            return
        torch.set_num_threads(self.shared)
        try:
            yield self.shared
        finally:
            torch.set_num_threads(self.full)

"""How many prompt tokens a local prefill computes between two decode steps.

A local prefill runs on the decode loop's thread, so while one of its chunks
computes no stream on that agent gets a token. Alone, a prompt goes through in
mlx-lm's own chunks (its numerics, its text); beside decoding streams, a chunk is
sized from what chunks and steps measured here so it costs about `steps` decode
steps, as vLLM's and SGLang's chunked prefill and mlx-lm server's
`prefill_step_size` keep a prompt from freezing the batch.
"""

from __future__ import annotations


class ChunkSizer:
    def __init__(self, full: int, floor: int = 32, steps: float = 1.5) -> None:
        self.full = full  # alone: mlx-lm generate_step's chunk
        self.floor = floor  # below this a chunk's fixed cost dominates
        self.steps = steps  # a chunk's budget, in decode steps
        self.token_s: float | None = None  # seconds per prompt token, recent chunks
        self.step_s: float | None = None  # seconds per decode step, recent steps

    def size(self, busy: bool) -> int:
        """The next chunk's tokens: mlx-lm's when nothing else decodes, else what
        fits the budget (the floor until both rates are measured)."""
        if not busy:
            return self.full
        if self.token_s is None or self.step_s is None:
            return self.floor
        fit = int(self.steps * self.step_s / self.token_s)
        return max(self.floor, min(self.full, fit))

    def observe_chunk(self, tokens: int, seconds: float) -> None:
        # Per token grows with the context a chunk attends to: recent ones weigh most.
        if tokens > 0 and seconds > 0:
            self.token_s = _ema(self.token_s, seconds / tokens)

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            self.step_s = _ema(self.step_s, seconds)


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else old + weight * (new - old)

"""Per-row sampling for the decode batch: each request's own temperature, top-p
and seeded random state, the rows of a step picked together."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class Sampler:
    """One request's temperature / top-p sampling. It draws from its own key, so a
    seed gives the same text whoever shares the batch; the rows of a step are then
    picked together (sample_rows)."""

    def __init__(self, temperature: float, top_p: float, seed: int | None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        seed = seed if seed is not None else int(np.random.randint(1 << 31))
        self.key = mx.random.key(seed)
        # Draft acceptance's draws (disagg_agents/decode/draft.py): seeded too, so a
        # seeded request that drafts gives the same text every run.
        self.rng = np.random.default_rng(seed)

    def noise(self, vocab: int) -> mx.array:
        """[1, vocab] Gumbel noise from this request's next key: argmax(logits +
        noise) is a draw from softmax(logits)."""
        self.key, sub = mx.random.split(self.key)
        return mx.random.gumbel(shape=(1, vocab), key=sub)


def make_sampler(temperature: float, top_p: float, seed: int | None) -> Sampler | None:
    """None means greedy."""
    return None if temperature == 0 else Sampler(temperature, top_p, seed)


def top_p_rows(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """mlx-lm's apply_top_p with one threshold per row ([R, 1]); a row at 1.0 keeps
    every token."""
    sorted_lp = mx.sort(logprobs, axis=-1)
    probs = mx.exp(sorted_lp.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_lp, dropped, axis=-1)
    cut = mx.where(logprobs < threshold, -mx.inf, logprobs)
    return mx.where(top_p >= 1.0, logprobs, cut)


def sample_rows(logprobs: mx.array, samplers: list[Sampler | None]) -> mx.array:
    """[B] tokens from [B, vocab] logprobs: one argmax for the greedy rows, and
    one for the sampled rows together (each with its own noise and settings)."""
    tokens = mx.argmax(logprobs, axis=-1)
    rows = [i for i, s in enumerate(samplers) if s is not None]
    if not rows:
        return tokens
    drawn = [s for s in samplers if s is not None]
    idx = mx.array(rows)
    picked = logprobs[idx]
    if any(s.top_p < 1.0 for s in drawn):
        picked = top_p_rows(picked, mx.array([[s.top_p] for s in drawn]))
    scale = mx.array([[1 / s.temperature] for s in drawn], dtype=picked.dtype)
    vocab = logprobs.shape[-1]
    noise = mx.concatenate([s.noise(vocab) for s in drawn]).astype(picked.dtype)
    tokens[idx] = mx.argmax(picked * scale + noise, axis=-1)
    return tokens

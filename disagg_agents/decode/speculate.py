"""The verify forward: every row's input token and draft in one batched forward
([B, L], rows with shorter drafts or none padded at the right: a padded position
comes after the row's real ones, so causality keeps it out of their logits, and
its K/V is dropped after: disagg_agents/decode/rewind.py), then what each row
takes (disagg_agents/decode/draft.py's rules). mlx thread."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from disagg_agents.decode.draft import accept_greedy, accept_sampled
from disagg_agents.decode.sampling import Sampler, sample_rows, top_p_rows

PAD = 0  # any id: its position is dropped


def verify_inputs(current: list[int], drafts: list[list[int]]) -> mx.array:
    """[B, L]: each row's input token, its draft, padding."""
    width = 1 + max(len(d) for d in drafts)
    rows = [[t, *d, *[PAD] * (width - 1 - len(d))] for t, d in zip(current, drafts, strict=True)]
    return mx.array(rows, dtype=mx.uint32)


def verify(model: Any, caches: list[Any], current: list[int], drafts: list[list[int]]) -> mx.array:
    """[B, L, vocab] logprobs after each row's input token and each drafted token."""
    logits = model(verify_inputs(current, drafts), cache=caches)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def judge(
    logprobs: mx.array,
    drafts: list[list[int]],
    samplers: list[Sampler | None],
    allowed: mx.array | None,
) -> list[list[int]]:
    """Each row's new tokens: its accepted draft, then the model's next token.
    Rows without a draft sample position 0 as a plain step does (a grammar row's
    mask `allowed` [B, vocab] applied); greedy drafts are checked against the
    argmax, sampled ones by speculative sampling."""
    first = logprobs[:, 0, :]
    if allowed is not None:
        first = mx.where(allowed, first, -mx.inf)
    plain = [None if d else s for d, s in zip(drafts, samplers, strict=True)]
    tokens0 = sample_rows(first, plain)
    targets = mx.argmax(logprobs, axis=-1)  # [B, L]
    mx.eval(tokens0, targets)
    firsts: list[int] = tokens0.tolist()  # type: ignore[assignment]
    greedy: list[list[int]] = targets.tolist()  # type: ignore[assignment]
    out: list[list[int]] = []
    for r, (d, s) in enumerate(zip(drafts, samplers, strict=True)):
        if not d:
            out.append([firsts[r]])
        elif s is None:
            out.append(accept_greedy(d, greedy[r][: len(d) + 1]))
        else:
            out.append(accept_sampled(d, row_probs(logprobs[r, : len(d) + 1], s), s.rng))
    return out


def row_probs(logprobs: mx.array, sampler: Sampler) -> np.ndarray:
    """[n, vocab] float64: the distribution the sampler draws from at each position
    (top-p cut on the logprobs, then the temperature), as sample_rows does."""
    picked = logprobs
    if sampler.top_p < 1.0:
        picked = top_p_rows(picked, mx.array([[sampler.top_p]] * picked.shape[0]))
    scaled = picked.astype(mx.float32) * (1 / sampler.temperature)
    probs = mx.softmax(scaled, axis=-1)
    return np.array(probs).astype(np.float64)

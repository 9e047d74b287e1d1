"""Compare a disaggregated greedy run with the decode agent prefilling itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.serving.completion import Completion


@dataclass(frozen=True)
class VerifyReport:
    """`disagg verify`'s finding: how far the disaggregated run's tokens and
    log-softmax kept to the decode agent prefilling alone."""

    model: str
    compared: int  # token positions compared (the longer run's)
    agreement: float  # of them, the share with the same token
    first_divergence: int | None  # None: the same tokens throughout
    max_logit_diff: float
    logit_diff_at_divergence: float | None
    kv_bytes: int | None
    # "mixed": the prefill agent ran other weights; the agreement is what that costs.
    weights: str | None
    disaggregated_text: str
    decode_only_text: str
    ok: bool
    error: str | None = None  # why it failed other than by disagreeing

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.error is None:
            del out["error"]
        return out


def compare(
    disagg: Completion, local: Completion, min_agreement: float, model: str
) -> VerifyReport:
    """Token agreement, first divergence, and the log-softmax gap the handoff caused."""
    a, b = disagg.token_ids, local.token_ids
    longest = max(len(a), len(b))
    same = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))  # one stopped (EOS) where the other went on
    steps = min(len(disagg.logprobs), len(local.logprobs))
    # Up to and including the divergence both runs saw the same tokens, so their
    # distributions are comparable position by position.
    upto = steps if first is None else min(steps, first + 1)
    diffs = [float(np.max(np.abs(disagg.logprobs[i] - local.logprobs[i]))) for i in range(upto)]
    agreement = same / longest if longest else 1.0
    return VerifyReport(
        model=model,
        compared=longest,
        agreement=agreement,
        first_divergence=first,
        max_logit_diff=max(diffs) if diffs else 0.0,
        logit_diff_at_divergence=diffs[first] if first is not None and first < len(diffs) else None,
        kv_bytes=disagg.metrics.kv_bytes,
        weights=disagg.metrics.weights,
        disaggregated_text=disagg.text,
        decode_only_text=local.text,
        ok=agreement >= min_agreement,
    )

"""Prompt-lookup drafts: a row proposes the tokens that followed the latest earlier
occurrence of its last n tokens (prompt and answer so far), and the model checks
them all in one forward. No draft model: what agent CLIs ask for repeats what
they sent (a file rewritten with one change, identifiers echoed into tool calls).

Pure host code (numpy only): the loop's verify step (disagg_agents/decode/speculate.py)
calls it; the acceptance rules here keep greedy token-identical and sampled
output distributed as without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_N = 4  # the longest n-gram looked up first
MIN_N = 2  # shorter matches propose too often to pay
K_START = 4
K_MAX = 10
FAILS_TO_PAUSE = 3  # drafts in a row with nothing accepted
PAUSE_FIRST = 16  # tokens without drafting after that, doubling while it keeps failing
PAUSE_MAX = 1024
MISSES_TO_PAUSE = 4  # steps in a row with no match: the row rests PAUSE_MISS tokens
PAUSE_MISS = 8


@dataclass
class Drafter:
    """One row's context (prompt + answer) and its n-gram index, updated as tokens
    are accepted; k adapts to what the row's drafts get accepted."""

    tokens: list[int]
    k: int = K_START
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, accepted
    forwards: int = 0  # verify forwards this row took part in with a draft
    longest: int = 0  # the longest accepted draft
    fails: int = 0  # consecutive drafts with nothing accepted
    pause: int = 0  # tokens to go without drafting
    pause_next: int = PAUSE_FIRST
    misses: int = 0  # steps in a row without a match
    # n-gram (tuple) -> the position of its last token, latest occurrence
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # positions whose n-grams are in `index`

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.pause:
            self.pause = max(0, self.pause - len(tokens))

    def propose(self) -> list[int]:
        """k tokens that followed the longest n-gram match of the context's end
        (its latest occurrence); [] when none or while paused. A match that runs
        into the end of the context goes on with the draft itself: a loop of
        period p (the same token over and over, p = 1) is drafted whole."""
        if self.pause:
            return []
        toks, last = self.tokens, len(self.tokens) - 1
        self._index_up_to(last)  # n-grams ending before the last token
        for n in range(min(MAX_N, last), MIN_N - 1, -1):
            at = self.index.get(tuple(toks[last - n + 1 :]))
            if at is not None:
                draft = toks[at + 1 : at + 1 + self.k]
                while len(draft) < self.k:  # the period is last - at
                    draft.append(draft[len(draft) - (last - at)])
                self.misses = 0
                return draft
        # No match: after a few, rest a while (a step that may draft reads its
        # inputs back before the forward, which a plain step does not).
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.pause, self.misses = PAUSE_MISS, 0
        return []

    def _index_up_to(self, end: int) -> None:
        toks, index = self.tokens, self.index
        for p in range(self.indexed, end):
            for n in range(MIN_N, MAX_N + 1):
                if p - n + 1 >= 0:
                    index[tuple(toks[p - n + 1 : p + 1])] = p
        self.indexed = max(self.indexed, end)

    def judged(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens had `accepted` of them accepted: k grows while
        drafts are taken whole, shrinks to what was taken, and a row whose drafts
        keep failing pauses (longer each time) so it costs nothing."""
        self.drafted += drafted
        self.accepted += accepted
        self.forwards += 1
        self.longest = max(self.longest, accepted)
        if accepted == drafted:
            self.k = min(K_MAX, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.fails, self.pause_next = 0, PAUSE_FIRST
            return
        self.fails += 1
        if self.fails >= FAILS_TO_PAUSE:
            self.pause, self.fails = self.pause_next, 0
            self.pause_next = min(PAUSE_MAX, 2 * self.pause_next)


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a greedy row takes: the draft's prefix that agrees with the
    model's argmax at each position, then the model's own next token.
    targets[j] is the argmax after the context and draft[:j] (len(draft) + 1)."""
    out: list[int] = []
    for d, t in zip(draft, targets, strict=False):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(draft)])
    return out


def accept_sampled(draft: list[int], probs: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Speculative sampling for a deterministic draft (q is a point mass on d):
    accept d with probability p(d), else draw from p with d removed (renormalized),
    and after a wholly accepted draft draw the next token from p. Each token is
    then distributed exactly as a draw from p. probs: [len(draft) + 1, vocab]."""
    out: list[int] = []
    for j, d in enumerate(draft):
        p = probs[j]
        if rng.random() < p[d]:
            out.append(d)
            continue
        rest = p.astype(np.float64, copy=True)
        rest[d] = 0.0
        out.append(draw(rest, rng))
        return out
    out.append(draw(probs[len(draft)].astype(np.float64), rng))
    return out


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn in proportion to `weights` (need not sum to one)."""
    cum = np.cumsum(weights)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(cum) - 1))

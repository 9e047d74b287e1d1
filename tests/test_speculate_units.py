"""Prompt-lookup drafts' rules (disagg_agents/decode/draft.py), no model: what a
row proposes, how k adapts and a failing row pauses, and that the acceptance
rules keep greedy exact and sampled tokens distributed as without drafts."""

from __future__ import annotations

from collections import Counter

import numpy as np

from disagg_agents.decode.draft import (
    FAILS_TO_PAUSE,
    K_MAX,
    K_START,
    MISSES_TO_PAUSE,
    PAUSE_MISS,
    Drafter,
    accept_greedy,
    accept_sampled,
)


def test_the_longest_match_proposes_what_followed_its_latest_occurrence() -> None:
    # "7 1 2" occurs once before (followed by 3 4 5); "1 2" alone last ends at 8 -> 9
    toks = [7, 1, 2, 3, 4, 5, 6, 1, 2, 9, 8, 7, 1, 2]
    d = Drafter(toks, k=3)
    assert d.propose() == [3, 4, 5]
    d2 = Drafter([0, 1, 2, 9, 5, 1, 2], k=2)  # no 3-gram match: the 2-gram's latest
    assert d2.propose() == [9, 5]


def test_no_match_no_draft_and_a_loop_is_drafted_whole() -> None:
    assert Drafter([1, 2, 3, 4, 5], k=4).propose() == []
    assert Drafter([9, 5, 6, 5, 6], k=5).propose() == [5, 6, 5, 6, 5]  # period 2
    assert Drafter([3, 8, 8, 8], k=4).propose() == [8, 8, 8, 8]  # period 1


def test_a_row_without_matches_rests() -> None:
    d = Drafter(list(range(10)), k=2)
    for _ in range(MISSES_TO_PAUSE):
        assert d.propose() == []
    assert d.pause == PAUSE_MISS
    d.append([0, 1])  # a match now, but it rests first
    assert d.propose() == []
    d.append(list(range(2, 2 + PAUSE_MISS)))
    assert d.propose() != []


def test_appending_tokens_updates_the_lookup() -> None:
    d = Drafter([1, 2, 3, 4], k=2)
    assert d.propose() == []
    d.append([1, 2])
    assert d.propose() == [3, 4]


def test_k_grows_on_whole_drafts_shrinks_on_partial_and_failing_rows_pause() -> None:
    d = Drafter([5, 6, 5, 6])
    assert d.k == K_START
    d.judged(K_START, K_START)
    assert d.k == K_START + 2
    for _ in range(10):
        d.judged(d.k, d.k)
    assert d.k == K_MAX
    d.judged(K_MAX, 2)
    assert d.k == 3  # what was taken, plus one
    for _ in range(FAILS_TO_PAUSE):
        assert d.propose() != []
        d.judged(d.k, 0)
    assert d.pause > 0 and d.propose() == []  # paused: no draft, no verify forward
    first_pause = d.pause
    d.append([5] * first_pause)
    assert d.pause == 0 and d.propose() != []
    for _ in range(FAILS_TO_PAUSE):
        d.judged(d.k, 0)
    assert d.pause == 2 * first_pause  # it keeps failing: a longer pause
    assert d.longest == K_MAX and d.accepted < d.drafted


def test_greedy_takes_the_agreeing_prefix_then_the_models_token() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all, plus the bonus
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the model's token at the miss
    assert accept_greedy([4, 5], [1, 5, 6]) == [1]


def chi2_ok(counts: np.ndarray, probs: np.ndarray, n: int) -> bool:
    """Pearson's chi-square of `counts` against n * probs, under a bound that a
    true sampler passes far more than 99.9 % of the time (df + 6 sqrt(2 df))."""
    keep = probs * n >= 5
    expected = probs[keep] * n
    stat = float((((counts[keep] - expected) ** 2) / expected).sum())
    df = int(keep.sum()) - 1
    return stat < df + 6 * np.sqrt(2 * df)


def joint(draws: list[list[int]], d0: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """First tokens' counts, and second tokens' counts where the first was d0."""
    first = np.bincount([o[0] for o in draws], minlength=vocab)
    second = np.bincount([o[1] for o in draws if o[0] == d0 and len(o) > 1], minlength=vocab)
    return first, second


def test_speculative_sampling_leaves_the_distribution_unchanged() -> None:
    """Tokens drawn through the acceptance rule: the first is distributed as p0,
    the second (after an accepted first) as p1 -- on distributions where the draft
    is likely, unlikely and impossible. A rule that always took the draft fails."""
    gen = np.random.default_rng(0)
    vocab, n = 12, 10000
    for d0_mass in (0.7, 0.2, 0.0):
        p = gen.dirichlet(np.ones(vocab), size=3)
        d = [3, 5]
        p[0] *= (1 - d0_mass) / (1 - p[0, 3])
        p[0, 3] = d0_mass
        rng = np.random.default_rng(1)
        draws = [accept_sampled(d, p, rng) for _ in range(n)]
        first, second = joint(draws, 3, vocab)
        assert chi2_ok(first, p[0], n), d0_mass
        if d0_mass:
            assert chi2_ok(second, p[1], int(second.sum())), d0_mass
    # The same check catches a rule that accepts the draft too often.
    rng = np.random.default_rng(1)
    biased = [[3] if rng.random() < 0.5 else accept_sampled([3], p[:2], rng) for _ in range(n)]
    assert not chi2_ok(np.bincount([o[0] for o in biased], minlength=vocab), p[0], n)


def test_a_seeded_sampler_accepts_the_same_way_every_run() -> None:
    p = np.random.default_rng(3).dirichlet(np.ones(8), size=4)
    runs = [
        [accept_sampled([1, 2, 3], p, rng) for _ in range(50)]
        for rng in (np.random.default_rng(9), np.random.default_rng(9))
    ]
    assert runs[0] == runs[1]
    assert len(Counter(map(tuple, runs[0]))) > 1  # it did draw

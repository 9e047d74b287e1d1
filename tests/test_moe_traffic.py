"""The layer's DRAM traffic counted from the kernels' grid and tiles
(disagg.bench.moetraffic): the launch order covers every tile once, a cache that
holds everything gives exactly the minimum's weights, and the N-fastest order moves
less than the 2-D grid before it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.bench import moetraffic
from disagg.bench.moelayer import spec_of
from disagg_agents.models import moetiles as tt


@pytest.mark.parametrize("group_m", [0, 1, 3, 8])
def test_the_launch_order_covers_every_tile_once(group_m: int) -> None:
    order = tt.program_order(7, 5, group_m)
    assert sorted(order) == [(b, n) for b in range(7) for n in range(5)]
    if group_m == 1:  # N-fastest: each block's tiles back to back
        assert order[:5] == [(0, n) for n in range(5)]


def test_an_lru_counts_only_what_it_no_longer_holds() -> None:
    lru = moetraffic.Lru(100)
    for key in ("a", "b", "a", "c", "a", "b"):
        lru.read((key,), 40)
    # a, b missed; a hit; c missed (b evicted: a was used later); a hit; b missed again
    assert sum(lru.missed.values()) == 160


def test_weights_are_read_once_and_the_new_order_moves_less() -> None:
    gpt = spec_of("gpt-oss-mxfp4")
    huge = replace(tt.GB10, l2=1 << 40)
    c = moetraffic.count(gpt, huge, 512)
    weights_min = c.minimum - 2 * c.out
    assert c.weights == pytest.approx(weights_min, rel=1e-3)
    for shape in ("qwen3-coder-4bit", "gpt-oss-mxfp4"):
        now = moetraffic.count(spec_of(shape), tt.GB10, 2048)
        before = moetraffic.count(spec_of(shape), tt.GB10, 2048, before=True)
        assert now.total < before.total
        assert now.acts < before.acts and now.inter < before.inter
        assert now.weights <= before.weights * 1.01
    assert moetraffic.count(gpt, tt.GB10, 2048).ratio <= 1.5


def test_top8_gathers_put_qwen3_coder_at_8k_over_the_target_even_fully_fused() -> None:
    """Why the 1.5x target is out of reach for Qwen3-Coder at 8k tokens: with the
    intermediate and the per-pair rows never leaving the chip, the weights, the
    gathered rows (8 per token) and the output alone are over it, and splitting the
    tokens into chunks (rows that fit the cache, weights read per chunk) is worse.
    At 2k the same floor leaves room: what is over there is the per-pair traffic."""
    qwen = spec_of("qwen3-coder-4bit")
    at_8k = moetraffic.count(qwen, tt.GB10, 8192)
    assert at_8k.floor_ratio > 1.5
    assert at_8k.floor_ratio < at_8k.ratio  # the floor leaves out what the kernel moves
    assert moetraffic.chunked_floor(qwen, tt.GB10, 8192) == at_8k.floor_ratio
    assert moetraffic.count(qwen, tt.GB10, 2048).floor_ratio < 1.2


def test_summing_the_slots_in_down_with_atomics_does_not_bring_qwen3_coder_to_the_target() -> None:
    """The other way to drop the per-pair rows: down adds each tile into the token's
    output row. Expert-major programs touch those rows in random token order, so
    with the weights streaming past they miss the cache: fp32 accumulators move more
    than today's per-pair rows, bf16 ones (rounded at every add, run-to-run order)
    about as much as the line at 2k. Neither meets 1.5x; at 8k neither is close."""
    qwen = spec_of("qwen3-coder-4bit")
    now = moetraffic.count(qwen, tt.GB10, 2048).ratio
    fp32 = moetraffic.summed_in_down(qwen, tt.GB10, 2048, 4)
    bf16 = moetraffic.summed_in_down(qwen, tt.GB10, 2048, 2)
    assert bf16 < now < fp32
    assert bf16 > 1.5
    assert moetraffic.summed_in_down(qwen, tt.GB10, 8192, 2) > 3.0

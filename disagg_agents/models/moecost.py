"""One MoE layer on the fused Triton kernel, from what its grid does: bytes as
stored and as read, FLOPs as computed (rows padded to whole blocks), and time at
an efficiency measured on a device of the same architecture.

The kernel (disagg_agents.quant.moe_triton) runs one program per (row block,
output tile), at the tiles `moetiles.tiles_for` picks on the device; a row block
holds up to `bm` (token, slot) pairs of one expert, and reads that expert's whole
weight (gate and up, then down) in its stored form. So:
- blocks: an expert with c pairs takes ceil(c / bm) blocks; experts no pair
  routes to take none (at a few tokens most of the 16 GB of experts is skipped);
- weights as read: one expert's packed weight per block;
- activations as read: a block's rows as often as the grid's order brings them
  back after they left the cache (`moetiles.row_reads`: once in the N-fastest
  order the kernel runs, once per output tile in the 2-D grid before it);
- FLOPs as computed: every row of every block, padding included.
Pure Python; routing taken as uniform (each pair picks an expert with p = k/E).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .moetiles import GB10, H200, DeviceProps, Tiles, recording_tiles, row_reads, tiles_for


@dataclass(frozen=True)
class Pick:
    """The tiles of the layer's two launches."""

    gate_up: Tiles
    down: Tiles


# What the tile choice reads of each architecture the cost model knows.
PROPS = {"sm121": GB10, "sm90": H200}


def kernel_tiles(props: DeviceProps, pairs: int, experts: int) -> Pick:
    """The tiles the kernel picks on `props` (the weight form only sets K tiles,
    which move no bytes here)."""
    return Pick(*(tiles_for(props, pairs, experts, k) for k in ("gate_up", "down")))


def recording_pick(pairs: int, experts: int) -> Pick:
    """The tiles and grid of the H200 recording of 2026-11-27 (moetiles.recording_tiles)."""
    t = recording_tiles(pairs, experts)
    return Pick(t, t)


def expected_blocks(tokens: int, top_k: int, experts: int, bm: int) -> float:
    """E x E[ceil(c / bm)] for c ~ Binomial(tokens, top_k / experts): the row blocks
    uniform routing fills (empty experts none)."""
    p = top_k / experts
    mean, sd = tokens * p, math.sqrt(tokens * p * (1 - p))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(tokens, int(mean + 12 * sd) + 2)
    log_p, log_q = math.log(p), math.log1p(-p) if p < 1 else -math.inf
    total = 0.0
    for c in range(lo, hi + 1):
        if p == 1:
            pmf = 1.0 if c == tokens else 0.0
        else:
            log_c = math.lgamma(tokens + 1) - math.lgamma(c + 1) - math.lgamma(tokens - c + 1)
            pmf = math.exp(log_c + c * log_p + (tokens - c) * log_q)
        total += pmf * -(-c // bm)
    return experts * total


@dataclass(frozen=True)
class LayerTraffic:
    """One MoE layer's work on the fused kernel."""

    flops: float  # of the routed pairs
    padded_flops: float  # as computed: whole blocks
    min_bytes: float  # the hit experts' packed weights once + activations in and out
    weight_bytes: float  # as read: an expert's packed weight per block
    act_bytes: float  # as read: activations as the grid brings them back, inter out, out
    blocks: float  # gate/up's row blocks

    @property
    def read_bytes(self) -> float:
        return self.weight_bytes + self.act_bytes


def layer_traffic(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    bits: float,
    tiles: Pick,
    act: int = 2,
) -> LayerTraffic:
    """`bits` per weight as stored (scales included); `act` bytes per activation;
    `tiles`: the two launches' (kernel_tiles on the device, or a recording's)."""
    pairs = tokens * top_k
    up, dn = tiles.gate_up, tiles.down
    blocks_up = expected_blocks(tokens, top_k, experts, up.bm)
    blocks_dn = blocks_up if dn.bm == up.bm else expected_blocks(tokens, top_k, experts, dn.bm)
    rows_up, rows_dn = blocks_up * up.bm, blocks_dn * dn.bm
    per_expert = 3 * hidden * inter  # gate, up [inter, hidden]; down [hidden, inter]
    hit = experts * (1 - (1 - top_k / experts) ** tokens)
    reads_up = row_reads(-(-inter // up.bn), up.group_m)
    reads_dn = row_reads(-(-hidden // dn.bn), dn.group_m)
    acts = act * (rows_up * hidden * reads_up + rows_dn * inter * reads_dn)
    acts += pairs * act * (inter + hidden)  # the intermediate written, the output written
    return LayerTraffic(
        flops=2.0 * pairs * per_expert,
        padded_flops=2.0 * hidden * inter * (2 * rows_up + rows_dn),
        min_bytes=hit * per_expert * bits / 8 + 2 * tokens * hidden * act,
        weight_bytes=hidden * inter * (2 * blocks_up + blocks_dn) * bits / 8,
        act_bytes=acts,
        blocks=blocks_up,
    )


@dataclass(frozen=True)
class KernelEfficiency:
    """The fused kernel's share of a device's nominal matmul FLOP/s, on the FLOPs it
    computes (padded blocks), as measured on one architecture."""

    arch: str
    padded: float
    source: str


# Refitted from the recorded runs by disagg.bench.costmodel.fit_kernel (the test checks
# this constant against the file, and each recorded layer against the prediction).
KERNEL_EFFICIENCY = {
    "sm90": KernelEfficiency(
        "sm90",
        0.160,
        "H200, 2026-11-27: Qwen3-Coder 4-bit and gpt-oss MXFP4 layers at 2k and 8k "
        "tokens (docs/bench-history/device-2026-11-27/moelayer-final.jsonl), of 989 "
        "TFLOP/s dense bf16",
    ),
}


def kernel_efficiency(arch: str) -> tuple[KernelEfficiency, bool]:
    """The efficiency measured on `arch`, or (until a device of it runs the kernel)
    the one measured on sm90; and whether it was measured on `arch` itself."""
    if arch in KERNEL_EFFICIENCY:
        return KERNEL_EFFICIENCY[arch], True
    return KERNEL_EFFICIENCY["sm90"], False


def layer_s(
    traffic: LayerTraffic, peak_flops: float, bandwidth: float, eff: KernelEfficiency
) -> float:
    """One layer's time: the longer of its computed FLOPs at the kernel's efficiency
    and its bytes as read at the bandwidth (no credit for caches)."""
    return max(traffic.padded_flops / (peak_flops * eff.padded), traffic.read_bytes / bandwidth)

"""One MoE layer on the fused Triton kernel, from what its grid does: bytes as
stored and as read, FLOPs as computed (rows padded to whole blocks), and time at
an efficiency measured on a device of the same architecture.

The kernel (disagg_agents.quant.moe_triton) runs one program per (row block,
output tile); a row block holds up to `bm` (token, slot) pairs of one expert, and
reads that expert's whole weight (gate and up, then down) in its stored form. So:
- blocks: an expert with c pairs takes ceil(c / bm) blocks; experts no pair
  routes to take none (at a few tokens most of the 16 GB of experts is skipped);
- weights as read: one expert's packed weight per block;
- activations as read: each output-tile pass re-reads its block's rows (the grid
  runs row blocks fastest), so gate/up reads them inter/bn times and down
  hidden/bn times, unless the grid keeps a block's rows in L2 across its tiles;
- FLOPs as computed: every row of every block, padding included.
Pure Python; routing taken as uniform (each pair picks an expert with p = k/E).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    bm: int  # rows (pairs) per block
    bn: int  # output columns per program


def kernel_tiles(pairs: int, experts: int) -> Tiles:
    """The tiles moe_triton.tiles() picks on CUDA today for this many pairs (a mirror:
    that function needs a torch device; its rule is 128-row blocks from 64 pairs an
    expert, 32 from 16, else 16; 128-wide tiles with 64-row blocks and up)."""
    per = pairs // max(experts, 1)
    bm = 128 if per >= 64 else (32 if per >= 16 else 16)
    return Tiles(bm, 128 if bm >= 64 else 64)


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
    act_bytes: float  # as read: activations per output-tile pass, intermediate out and in
    blocks: float

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
    act: int = 2,
    tiles: Tiles | None = None,
    reread: bool = True,
) -> LayerTraffic:
    """`bits` per weight as stored (scales included); `act` bytes per activation;
    `reread`: the grid re-reads a block's rows per output tile (today's order)."""
    pairs = tokens * top_k
    t = tiles or kernel_tiles(pairs, experts)
    blocks = expected_blocks(tokens, top_k, experts, t.bm)
    rows = blocks * t.bm
    per_expert = 3 * hidden * inter  # gate, up [inter, hidden]; down [hidden, inter]
    hit = experts * (1 - (1 - top_k / experts) ** tokens)
    passes_up = -(-inter // t.bn) if reread else 1
    passes_down = -(-hidden // t.bn) if reread else 1
    acts = rows * act * (hidden * passes_up + inter * passes_down)
    acts += pairs * act * (inter + hidden)  # the intermediate written, the output written
    return LayerTraffic(
        flops=2.0 * pairs * per_expert,
        padded_flops=2.0 * rows * per_expert,
        min_bytes=hit * per_expert * bits / 8 + 2 * tokens * hidden * act,
        weight_bytes=blocks * per_expert * bits / 8,
        act_bytes=acts,
        blocks=blocks,
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

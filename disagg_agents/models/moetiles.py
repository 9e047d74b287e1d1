"""The fused MoE kernel's tiles and program order, as pure functions of numbers.

The kernel (disagg_agents.quant.moe_triton) launches with these tiles; the cost
model (moecost, `disagg plan`, which may run without torch) and the traffic count
(disagg.bench.moetraffic) read the same table and the same order, so what they
predict is what the kernel runs. No torch, no triton here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

# The kernel's weight forms and GLUs (moe_kernels' constants are these): named here
# so that reading a layer's form needs neither torch nor the kernels' module.
FORM_PLAIN, FORM_AFFINE, FORM_MXFP4 = 0, 1, 2
GLU_NONE, GLU_SWIGLU, GLU_GPT_OSS = 0, 1, 2


@dataclass(frozen=True)
class DeviceProps:
    """What the tile choice reads of a GPU, as plain numbers (a CPU test passes its
    own): compute capability, the opt-in shared memory per block in bytes, SMs and
    L2 bytes (the last two for counting traffic, not for the choice)."""

    capability: tuple[int, int]
    shared: int
    sms: int = 0
    l2: int = 0


# The user's Spark (GB10: 101,376 B is Triton's limit there; 48 SMs; L2 taken as
# 24 MiB, not read from a device here) and the H200 the kernels were timed on.
GB10 = DeviceProps((12, 1), 101_376, 48, 24 << 20)
H200 = DeviceProps((9, 0), 232_448, 132, 50 << 20)


@dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    # Row blocks that sweep the N tiles together (moe_kernels.swizzle). 1: each block
    # sweeps all N tiles before the next (its activations read once, from L2 after
    # the first tile) and the next block of the same expert finds the expert's
    # weights in L2: counted, weights once and 1.5x the least traffic for gpt-oss at
    # 8k tokens, against 1.6-2x with groups of 4-16 (disagg.bench.moetraffic).
    # 0: the 2-D grid before the swizzle (row blocks fastest, then N tiles).
    group_m: int = 1


KERNELS = ("gate_up", "down")
INTERPRETED = Tiles(32, 32, 32, 1, 1, 2)  # few big programs: each is numpy calls

# Per capability family, per band of rows per expert (pairs // experts: < 16, < 64,
# more), (gate_up, down). Every entry compiles for its arch with no register spill
# for both user models (tests/test_moe_aot.py). sm_12x (GB10: mma.sync, ~99 KB of
# shared memory): 64-row blocks, 4 warps, 2-3 stages, as vLLM's sm_120 configs; the
# fused gate/up keeps two accumulators, so its N tile is 64. sm_90/100: 128-row
# blocks and 8 warps (the H200's fastest in a sweep), N 64 where two accumulators
# of 128 would spill. sm_80/89: sm_12x's, whose shared memory they exceed.
_SM12 = {
    "few": (Tiles(16, 64, 64, 4, 2), Tiles(16, 64, 64, 4, 2)),
    "some": (Tiles(32, 64, 64, 4, 2), Tiles(32, 64, 64, 4, 3)),
    "many": (Tiles(64, 64, 64, 4, 2), Tiles(64, 64, 64, 4, 3)),
}
_SM90 = {
    "few": (Tiles(16, 64, 64, 4, 3), Tiles(16, 64, 64, 4, 3)),
    "some": (Tiles(32, 64, 64, 4, 3), Tiles(32, 128, 64, 4, 3)),
    "many": (Tiles(128, 64, 64, 8, 3), Tiles(128, 128, 64, 8, 3)),
}
TABLE = {"sm_12x": _SM12, "sm_90": _SM90, "sm_80": _SM12}


def family(capability: tuple[int, int]) -> str:
    major = capability[0]
    return "sm_12x" if major >= 11 else "sm_90" if major in (9, 10) else "sm_80"


def band(pairs: int, experts: int) -> str:
    per = pairs // max(experts, 1)
    return "many" if per >= 64 else "some" if per >= 16 else "few"


def smem_estimate(t: Tiles, kernel: str) -> int:
    """Shared bytes the software pipeline may hold: per stage a [bm, bk] activation
    tile and one (down) or two (gate, up) [bk, bn] weight tiles, 2-byte values.
    Above what Triton allocates for these kernels (dequantized tiles stay in
    registers), so a fit here is a fit there."""
    weights = 2 if kernel == "gate_up" else 1
    return t.stages * (t.bm * t.bk + weights * t.bk * t.bn) * 2


def clamp(t: Tiles, shared: int, kernel: str) -> Tiles:
    """`t` shrunk until smem_estimate fits `shared`: stages to 2, then N, K, rows."""
    while smem_estimate(t, kernel) > shared:
        if t.stages > 2:
            t = replace(t, stages=t.stages - 1)
        elif t.bn > 32:
            t = replace(t, bn=t.bn // 2)
        elif t.bk > 32:
            t = replace(t, bk=t.bk // 2)
        elif t.bm > 16:
            t = replace(t, bm=t.bm // 2)
        else:
            break
    return t


def tiles_for(
    props: DeviceProps, pairs: int, experts: int, kernel: str, form: int = 0, group: int = 0
) -> Tiles:
    """The tiles for one kernel ("gate_up" or "down") on a device: a pure function of
    numbers. MXFP4's 32-input groups: K tiles of one group (one scale per row per
    tile), which keep the fused gate/up spill-free on sm_12x."""
    up, down = TABLE[family(props.capability)][band(pairs, experts)]
    t = up if kernel == "gate_up" else down
    if form == FORM_MXFP4 and group and t.bk > group and kernel == "gate_up":
        t = replace(t, bk=group)
    return clamp(t, props.shared, kernel)


def program_order(nb: int, nn: int, group_m: int) -> list[tuple[int, int]]:
    """(block, N tile) per program in launch order: moe_kernels.swizzle's mapping;
    group_m 0: the 2-D grid before it (blocks fastest, then N tiles)."""
    if group_m == 0:
        return [(b, n) for n in range(nn) for b in range(nb)]
    out = []
    for pid in range(nb * nn):
        width = group_m * nn
        first = (pid // width) * group_m
        size = min(nb - first, group_m)
        out.append((first + (pid % width) % size, (pid % width) // size))
    return out


def row_reads(nn: int, group_m: int, nb: int = 64) -> float:
    """How many times a row block's activations come from memory, per block, when
    the cache holds the rows of the blocks of one group (one block for the 2-D
    grid), walking `program_order`: 1 when a block's N tiles run together, `nn`
    when every N tile pass comes back to the block after all the others."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for b, _ in program_order(nb, nn, group_m):
        if b in cache:
            cache.move_to_end(b)
            continue
        misses += 1
        cache[b] = None
        if len(cache) > max(group_m, 1):
            cache.popitem(last=False)
    return misses / nb


def recording_tiles(pairs: int, experts: int) -> Tiles:
    """The tiles and 2-D grid every device ran before the table: those of the H200
    layer recording of 2026-11-27 (docs/bench-history/device-2026-11-27), kept to
    predict that recording with what it ran, and to show the spill check fails on
    them. 128-row blocks from 64 pairs an expert, 32 from 16, else 16."""
    per = pairs // max(experts, 1)
    bm = 128 if per >= 64 else (32 if per >= 16 else 16)
    return Tiles(bm, 128 if bm >= 64 else 64, 64, 8 if bm == 128 else 4, 3, 0)

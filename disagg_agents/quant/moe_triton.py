"""The MoE experts as two fused Triton GEMMs: gate and up with the GLU, then down
with each pair's routing weight, stored straight at the pair's place in token order.

Why: on CUDA, torch's fast grouped GEMM is bf16 on sm90/sm100 only, and packed
weights would be dequantized whole on every forward. Here the weights are read
in their stored form (MLX affine 2/4/8-bit, MXFP4, or plain) and dequantized in
registers, one (row block, output tile) of one expert per program, with no weight
copy per block and no host sync (the grid is fixed by the shapes; blocks past the
routing's end are empty and return). The same kernels run on CPU tensors under
TRITON_INTERPRET=1 (slowly), which is how CI checks them against the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .dequant import Packed
from .moe import Routing

INTERPRET_ENV = "TRITON_INTERPRET"
TILES_ENV = "DISAGG_MOE_TILES"


def interpreted() -> bool:
    return os.environ.get(INTERPRET_ENV) == "1"


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: CUDA with Triton, or a
    CPU under TRITON_INTERPRET=1 (the tests' way)."""
    if not _installed():
        return False
    if device.type == "cuda":
        return not interpreted()
    return device.type == "cpu" and interpreted()


@dataclass(frozen=True)
class Stored:
    """One stacked expert weight [E, N, K] in the kernel's terms."""

    data: torch.Tensor  # plain [E, N, K], or packed bytes [E, N, K*bits/8]
    scales: torch.Tensor  # [E, N, K/group] (affine: compute dtype; mxfp4: E8M0 bytes)
    biases: torch.Tensor  # affine biases, like scales (else a stand-in)
    form: int
    bits: int
    group: int

    @property
    def n(self) -> int:
        return self.data.shape[1]


def stored(w: Packed | torch.Tensor) -> Stored | None:
    """`w` as the kernel reads it, or None for a form it does not read (2/3/5/6-bit
    affine, mxfp8, nvfp4, inputs not a multiple of 16: those keep the other paths)."""
    from . import moe_kernels as k

    if isinstance(w, torch.Tensor) or w.kept is not None:
        plain = w if isinstance(w, torch.Tensor) else w.kept
        assert plain is not None
        if plain.shape[-1] % 16:
            return None
        if plain.stride(-1) != 1:  # strided rows (a view of gate_up) are read in place
            plain = plain.contiguous()
        return Stored(plain, plain, plain, k.FORM_PLAIN, 16, 1)
    spec = w.spec
    pow2 = spec.group_size & (spec.group_size - 1) == 0
    if w.n_in % 16 or not pow2:
        return None
    if spec.mode == "affine" and spec.bits in (4, 8):
        assert w.biases is not None
        return Stored(w.packed, w.scales, w.biases, k.FORM_AFFINE, spec.bits, spec.group_size)
    if spec.mode == "mxfp4":
        return Stored(w.packed, w.scales, w.scales, k.FORM_MXFP4, 4, spec.group_size)
    return None


def blocks(r: Routing, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of at most `bm` sorted rows of one expert: its expert, first row and
    end row (int32, on the device). The count is an upper bound fixed by the shapes,
    sum(ceil(count/bm)) <= ceil((S + E*(bm-1)) / bm); blocks past it are empty."""
    s, e = r.pairs, r.num_experts
    ends = r.ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    per = (counts + bm - 1) // bm
    blk_ends = torch.cumsum(per, 0)
    nb = max(1, (s + e * (bm - 1) + bm - 1) // bm)
    b = torch.arange(nb, device=ends.device)
    ex = torch.searchsorted(blk_ends, b, right=True)
    valid = ex < e
    ex = ex.clamp_(max=e - 1)
    start = (ends - counts)[ex] + (b - (blk_ends - per)[ex]) * bm
    end = torch.where(valid, torch.minimum(start + bm, ends[ex]), start)
    return ex.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


@dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


def tiles(device: torch.device, pairs: int, experts: int) -> Tiles:
    """Tile sizes: big tiles on a GPU (64 rows per block once experts average that
    many pairs), few big programs in the interpreter (each program is numpy calls)."""
    if device.type != "cuda":
        return Tiles(32, 32, 32, 1, 1)
    forced = os.environ.get(TILES_ENV)  # "bm,bn,bk,warps,stages": for sweeps on a device
    if forced:
        bm, bn, bk, warps, stages = (int(v) for v in forced.split(","))
        return Tiles(bm, bn, bk, warps, stages)
    # The in-register dequantization is paid once per row block: big blocks pay off
    # (H200: 128-row blocks fastest for both user models at 2k and 8k tokens).
    per = pairs // max(experts, 1)
    bm = 128 if per >= 64 else (32 if per >= 16 else 16)
    return Tiles(bm, 128 if bm >= 64 else 64, 64, 8 if bm == 128 else 4, 3)


def _glu_code(kind: str, act: Any) -> int | None:
    from . import moe_kernels as k

    if kind == "gpt_oss":
        return k.GLU_GPT_OSS
    silu = act is F.silu or isinstance(act, torch.nn.SiLU)
    return k.GLU_SWIGLU if silu or type(act).__name__ == "SiLUActivation" else None


@dataclass(frozen=True)
class Experts:
    """A PackedExperts layer in the kernel's terms (made once, on first use)."""

    gate: Stored
    up: Stored
    down: Stored
    glu: int
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    alpha: float
    limit: float


def prepare(
    kind: str,
    weights: tuple[Packed | torch.Tensor, Packed | torch.Tensor, Packed | torch.Tensor],
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    act: Any,
    alpha: float,
    limit: float,
) -> Experts | None:
    """The layer as the kernels read it, or None if any part is a form they don't
    (then the caller keeps its own path)."""
    glu = _glu_code(kind, act)
    parts = [stored(w) for w in weights]
    if glu is None or any(p is None for p in parts):
        return None
    gate, up, down = parts
    assert gate is not None and up is not None and down is not None
    if (gate.form, gate.bits, gate.group) != (up.form, up.bits, up.group):
        return None
    if biases is not None:
        biases = (biases[0].contiguous(), biases[1].contiguous(), biases[2].contiguous())
    return Experts(gate, up, down, glu, biases, alpha, limit)


def _launch(
    x: torch.Tensor,
    a: Stored,
    b: Stored | None,
    y: torch.Tensor,
    lay: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    t: Tiles,
    *,
    tokens: torch.Tensor | None,
    glu: int,
    bias: tuple[torch.Tensor, torch.Tensor | None] | None,
    row_weights: torch.Tensor | None,
    out_rows: torch.Tensor | None,
    alpha: float,
    limit: float,
) -> None:
    from . import moe_kernels as k

    n, kdim = a.n, x.shape[1]
    bk = next(b for b in (t.bk, 32, 16) if kdim % b == 0)  # K is a multiple of 16
    second = b if b is not None else a
    bias_a = bias[0] if bias is not None else y
    bias_b = bias[1] if bias is not None and bias[1] is not None else bias_a
    grid = (lay[0].shape[0], (n + t.bn - 1) // t.bn)
    # The interpreter's bf16 arithmetic is wrong; fp32 (CPU) dots are exact there.
    dot_f32 = interpreted() or x.dtype == torch.float32
    k.moe_gemm_kernel[grid](
        x, tokens if tokens is not None else lay[1], x.stride(0),
        a.data, a.scales, a.biases, second.data, second.scales, second.biases,
        bias_a, bias_b, n,
        row_weights if row_weights is not None else y, out_rows if out_rows is not None else lay[1],
        y, y.stride(0),
        lay[0], lay[1], lay[2],
        n, kdim,
        a.data.stride(0), a.data.stride(1), a.scales.stride(0), a.scales.stride(1),
        alpha, limit,
        FORM=a.form, BITS=a.bits, GROUP=a.group,
        GATHER=tokens is not None, FUSED=b is not None, GLU=glu,
        HAS_BIAS=bias is not None, HAS_RW=row_weights is not None, SCATTER=out_rows is not None,
        DOT_F32=dot_f32,
        BM=t.bm, BN=t.bn, BK=bk, num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip


def forward(
    m: Experts, hidden: torch.Tensor, r: Routing, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: the experts' GLU MLPs over the routed pairs, each
    scaled by its routing weight and summed over the slots."""
    t_, k_ = top_k_weights.shape
    hidden = hidden.contiguous()
    t = tiles(hidden.device, r.pairs, r.num_experts)
    lay = blocks(r, t.bm)
    inter = hidden.new_empty(r.pairs, m.gate.n)
    b = m.biases
    _launch(
        hidden, m.gate, m.up, inter, lay, t, tokens=r.tokens, glu=m.glu,
        bias=(b[0], b[1]) if b is not None else None, row_weights=None, out_rows=None,
        alpha=m.alpha, limit=m.limit,
    )  # fmt: skip
    out = hidden.new_empty(t_ * k_, m.down.n)
    rw = top_k_weights.reshape(-1).to(torch.float32)[r.order].contiguous()
    _launch(
        inter, m.down, None, out, lay, t, tokens=None, glu=0,
        bias=(b[2], None) if b is not None else None, row_weights=rw, out_rows=r.order,
        alpha=m.alpha, limit=m.limit,
    )  # fmt: skip
    return out.view(t_, k_, -1).sum(dim=1)

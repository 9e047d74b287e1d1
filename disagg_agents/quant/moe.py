"""Mixture-of-experts routing shaped for a GPU: every (token, slot) pair at once.

No host syncs inside a layer (no `nonzero`, `.item()`, `where(cond)`, `unique`):
the pairs are sorted by expert, each expert's end offset is found on the device,
and the expert GEMMs run as one grouped GEMM over the sorted rows. Every shape
is fixed by tokens x top-k and the number of experts, never by the routing.

Three ways to run the grouped GEMM:
- `triton` (moe_triton): fused Triton kernels that read packed weights as stored
  and dequantize in registers; the default on CUDA, any arch.
- `torch.nn.functional.grouped_mm`: one aten op. Its CPU kernel takes fp32,
  bf16 and fp16; on CUDA its fast kernel is bf16 on sm90/sm100 only, and other
  cases fall back to a loop that copies the offsets to the host (a sync).
- `blocked`: rows padded per expert to blocks of `block`, one batched GEMM over
  the blocks with each block's expert weight gathered (sync-free anywhere, at the
  cost of reading about (pairs / block + experts) experts' weights). With
  block 1 it is the per-pair GEMM, which dequantizes only the experts of the
  pairs: the cheaper choice for packed weights when pairs < experts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 64  # rows per block of the blocked GEMM (padding is at most BLOCK-1 rows per expert)
# Which grouped GEMM runs: for measuring each on a device, and for tests.
GEMM_ENV = "DISAGG_MOE_GEMM"
GEMMS = ("auto", "triton", "grouped", "blocked")

# Gives the weights [n, out, in] of the experts `idx` [n] (dequantized if packed).
Take = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Routing:
    """The (token, slot) pairs of one MoE call, sorted by expert (stable: token order
    kept within an expert). S = tokens x top-k pairs; E experts."""

    order: torch.Tensor  # [S] int64: the flat pair index (token * top_k + slot) at each sorted row
    tokens: torch.Tensor  # [S] int64: the token of each sorted row
    experts: torch.Tensor  # [S] int64: the expert of each sorted row (ascending)
    ends: torch.Tensor  # [E] int32: end offset of each expert's rows (grouped_mm's `offs`)
    num_experts: int

    @property
    def pairs(self) -> int:
        return self.order.shape[0]


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the pairs of `top_k_index` [T, k] by expert, with offsets on the device."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    # ends[e] = pairs routed to experts <= e. searchsorted rather than bincount +
    # cumsum: CUDA's bincount reads the input's max on the host to size its output.
    ids = torch.arange(num_experts, device=flat.device, dtype=experts.dtype)
    ends = torch.searchsorted(experts, ids, right=True, out_int32=True)
    return Routing(order, order // k, experts, ends, num_experts)


def grouped_mm_fits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `grouped_mm` runs on `device` in `dtype` without a host sync."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda":
        # The fast (CUTLASS) kernel; elsewhere torch loops over offsets copied to the host.
        major = torch.cuda.get_device_capability(device)[0]
        return dtype == torch.bfloat16 and major in (9, 10)
    return False


def pick_gemm(
    x: torch.Tensor, w_dtype: torch.dtype, kept: bool, r: Routing, triton_ok: bool = False
) -> tuple[str, int]:
    """("triton", 0), ("grouped", 0) or ("blocked", block) for these shapes; never
    reads the routing.

    On CUDA the Triton kernels (`triton_ok`: they read these weights) unless the
    weights are kept and grouped_mm's fast kernel runs. Elsewhere: packed weights
    with fewer pairs than experts take per-pair blocks (only the routed experts are
    dequantized); else grouped_mm where it is sync-free; else blocks.
    """
    want = os.environ.get(GEMM_ENV, "auto")
    if want not in GEMMS:
        raise ValueError(f"{GEMM_ENV}={want!r}: expected one of {', '.join(GEMMS)}")
    fits = x.dtype == w_dtype and grouped_mm_fits(x.device, w_dtype)
    if want == "triton":
        if not triton_ok:
            raise RuntimeError(
                f"{GEMM_ENV}=triton: the Triton MoE kernels need CUDA (or TRITON_INTERPRET=1 "
                "on a CPU, for tests) and weights in bf16/fp32, MLX affine 2/4/8-bit or MXFP4"
            )
        return "triton", 0
    if want == "auto" and triton_ok and x.device.type == "cuda" and not (kept and fits):
        return "triton", 0
    if not kept and r.pairs < r.num_experts and want == "auto":
        return "blocked", 1
    if want == "grouped" or (want == "auto" and fits):
        return "grouped", 0
    return "blocked", BLOCK


def grouped_linear(x: torch.Tensor, w: torch.Tensor, r: Routing) -> torch.Tensor:
    """x [S, in] sorted by expert, w [E, out, in] (Linear orientation) -> [S, out]."""
    return F.grouped_mm(x, w.transpose(-2, -1), offs=r.ends)


def blocked_layout(r: Routing, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each sorted row goes once every expert's rows are padded to whole blocks
    ([S] int64), the expert of each block ([NB] int64), and NB, an upper bound fixed
    by the shapes: sum(ceil(count/block)) <= ceil((S + E*(block-1)) / block)."""
    s, e = r.pairs, r.num_experts
    dev = r.experts.device
    ends = r.ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block - 1) // block * block
    pad_ends = torch.cumsum(padded, 0)
    shift = (pad_ends - padded) - (ends - counts)  # padded start - packed start, per expert
    dest = torch.arange(s, device=dev) + shift[r.experts]
    nb = (s + e * (block - 1) + block - 1) // block
    starts = torch.arange(nb, device=dev) * block
    block_expert = torch.searchsorted(pad_ends, starts, right=True).clamp_(max=e - 1)
    return dest, block_expert, nb


def blocked_linear(
    x: torch.Tensor, take: Take, layout: tuple[torch.Tensor, torch.Tensor, int], block: int
) -> torch.Tensor:
    """x [S, in] sorted by expert -> [S, out], one bmm over blocks of `block` rows
    of one expert each; `take(idx)` gives the weights [n, out, in] of experts idx."""
    dest, block_expert, nb = layout
    xp = x.new_zeros(nb * block, x.shape[1]).index_copy_(0, dest, x)
    w = take(block_expert)  # [NB, out, in]
    y = torch.bmm(xp.view(nb, block, -1), w.transpose(1, 2))  # [NB, block, out]
    return y.reshape(nb * block, -1).index_select(0, dest)


def combine(
    y: torch.Tensor, r: Routing, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """y [S, hidden] in sorted order, weights [T, k] -> [T, hidden]: each pair scaled
    by its routing weight, back in (token, slot) order, summed over the slots."""
    t, k = weights.shape
    y = y * weights.reshape(-1)[r.order].unsqueeze(-1).to(y.dtype)
    back = torch.empty_like(y).index_copy_(0, r.order, y)  # deterministic, unlike index_add_
    return back.view(t, k, -1).sum(dim=1).to(out_dtype)

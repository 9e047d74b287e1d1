"""The Triton kernels of the fused MoE GEMM (imported only by `moe_triton`).

One program computes one (row block, output tile) of one expert: rows are the
(token, slot) pairs sorted by expert, a block holds rows of a single expert, and
the expert's weight tile is read in its stored form and dequantized in registers
(MLX affine 2/4/8-bit with group scales and biases, OpenAI MXFP4 with E8M0
scales, or plain). Nothing is copied per block and no host sync is needed: empty
blocks (the grid is sized by the shapes, not the routing) return at once.

`triton.jit` reads TRITON_INTERPRET when this module is imported: under it the
same kernels run on CPU tensors (numpy underneath), which is how CI tests them.
The interpreter computes bf16 arithmetic wrongly, so every load is widened to
fp32 and `DOT_F32` keeps the dot's operands in fp32 there (and for fp32 models:
"ieee", not the TF32 a GPU would use by default).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The forms and GLUs, named where torch-free code can read them too.
from ..models.moetiles import FORM_AFFINE as FORM_AFFINE
from ..models.moetiles import FORM_MXFP4 as FORM_MXFP4
from ..models.moetiles import FORM_PLAIN as FORM_PLAIN
from ..models.moetiles import GLU_GPT_OSS as GLU_GPT_OSS
from ..models.moetiles import GLU_NONE as GLU_NONE
from ..models.moetiles import GLU_SWIGLU as GLU_SWIGLU


@triton.jit
def _e2m1(q):
    """fp32 values of E2M1 codes (int32, 0..15), built from bits: the three magnitude
    bits shifted under the exponent (e, m -> 2^(e-1) * (1 + m/2)), e == 0 the
    subnormal 0 or 0.5, bit 3 the sign. No table and no float select chain: a
    few integer ops per value keep the decoded tile small in registers."""
    mag = q & 7
    bits = tl.where(mag >= 2, (mag << 22) + 0x3F000000, mag * 0x3F000000)
    return (bits | ((q & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, b_ptr, e, ns, k0, nmask,
    stride_we, stride_wn, stride_se, stride_sn,
    FORM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """[BN, BK] fp32: rows `ns`, inputs k0..k0+BK of expert `e`'s weight, dequantized.

    K is a multiple of BK, and BK and GROUP divide one another (powers of two): the
    packed bytes are read once each ([BN, BK*BITS/8]) and split into codes, and
    each row's scales are read once per group, then broadcast over the group.
    """
    m = nmask[:, None]
    row = w_ptr + e.to(tl.int64) * stride_we + ns[:, None].to(tl.int64) * stride_wn
    if FORM == 0:
        w = tl.load(row + k0 + tl.arange(0, BK)[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        if BITS == 8:
            q = tl.load(row + k0 + tl.arange(0, BK)[None, :], mask=m, other=0).to(tl.int32)
        else:  # 4 bits: two codes per byte, low nibble first
            kb = k0 // 2 + tl.arange(0, BK // 2)
            byte = tl.load(row + kb[None, :], mask=m, other=0).to(tl.int32)
            q = tl.reshape(tl.join(byte & 15, (byte >> 4) & 15), (BN, BK))
        # MLX affine: q * scale + bias per group, in the scales' dtype; else E2M1.
        v = q.to(tl.float32) if FORM == 1 else _e2m1(q)
        srow = s_ptr + e.to(tl.int64) * stride_se + ns.to(tl.int64) * stride_sn
        if GROUP >= BK:  # one group per row in this tile
            sc = tl.load(srow + k0 // GROUP, mask=nmask, other=0)[:, None]
        else:  # BK // GROUP groups per row, broadcast over [BN, groups, GROUP]
            gs = k0 // GROUP + tl.arange(0, BK // GROUP)
            sc = tl.load(srow[:, None] + gs[None, :], mask=m, other=0)[:, :, None]
            v = tl.reshape(v, (BN, BK // GROUP, GROUP))
        if FORM == 1:
            brow = b_ptr + e.to(tl.int64) * stride_se + ns.to(tl.int64) * stride_sn
            if GROUP >= BK:
                bi = tl.load(brow + k0 // GROUP, mask=nmask, other=0)[:, None]
            else:
                bi = tl.load(brow[:, None] + gs[None, :], mask=m, other=0)[:, :, None]
            # Two rounded ops in the scales' dtype, as mx.dequantize computes them.
            prod = (v * sc.to(tl.float32)).to(s_ptr.dtype.element_ty).to(tl.float32)
            w = prod + bi.to(tl.float32)
        else:
            s = sc.to(tl.int32)
            scale = (s << 23).to(tl.float32, bitcast=True)
            scale = tl.where(s == 0, 5.877471754111438e-39, scale)  # E8M0 0 is 2^-127
            w = v * scale
        w = tl.reshape(w, (BN, BK))
    return w


@triton.jit
def _dot(acc, a, w, DOT_F32: tl.constexpr):
    """acc + a @ w.T; fp32 operands exact ("ieee", not a GPU's default TF32)."""
    if DOT_F32:
        return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(a, tl.trans(w))


@triton.jit
def _tile_dot(
    acc, a, w_ptr, s_ptr, b_ptr, e, ns, k0, nmask,
    stride_we, stride_wn, stride_se, stride_sn,
    FORM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """acc + a @ w.T for expert `e`'s weight tile (_weight_tile) in a's dtype."""
    w = _weight_tile(
        w_ptr, s_ptr, b_ptr, e, ns, k0, nmask,
        stride_we, stride_wn, stride_se, stride_sn, FORM, BITS, GROUP, BN, BK,
    ).to(a.dtype)  # fmt: skip
    return _dot(acc, a, w, DOT_F32)


@triton.jit
def _rows_at(idx_ptr, rows, rmask, USE: tl.constexpr):
    """int64 row indices: idx[rows] when USE, else the rows themselves."""
    if USE:
        return tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    return rows.to(tl.int64)


@triton.jit
def _glu(a, b, alpha, limit, GLU: tl.constexpr):
    """The activation of the gate (a) and up (b) accumulators."""
    if GLU == 1:  # qwen3_moe: silu(gate) * up
        return a * tl.sigmoid(a) * b
    if GLU == 2:  # gpt_oss: clamped, (up + 1) * gate * sigmoid(alpha * gate)
        g = tl.minimum(a, limit)
        u = tl.minimum(tl.maximum(b, -limit), limit)
        return (u + 1.0) * (g * tl.sigmoid(g * alpha))
    return a


@triton.jit
def swizzle(pid, NB, NN, GROUP_M: tl.constexpr):
    """(row block, N tile) of program `pid`: GROUP_M consecutive row blocks (mostly
    one expert's: blocks are sorted by expert) sweep every N tile together, the
    blocks varying fastest; GROUP_M 1 is N-fastest. Either way a block's
    activations stay in L2 across its N tiles (the 2-D grid before read them again
    per N tile) and an expert's weight tiles serve its blocks close together."""
    width = GROUP_M * NN
    first = (pid // width) * GROUP_M
    size = tl.minimum(NB - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit(do_not_specialize=["NB"])  # the block count varies per call: one compile
def moe_gemm_kernel(
    x_ptr, tok_ptr, stride_xm,
    wa_ptr, sa_ptr, ba_ptr, wb_ptr, sb_ptr, bb_ptr,
    bias_a_ptr, bias_b_ptr, stride_bias,
    rw_ptr, out_row_ptr, y_ptr, stride_ym,
    blk_expert_ptr, blk_start_ptr, blk_end_ptr, NB,
    N, K,
    stride_we, stride_wn, stride_se, stride_sn,
    alpha, limit,
    FORM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    GATHER: tl.constexpr, FUSED: tl.constexpr, GLU: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RW: tl.constexpr, SCATTER: tl.constexpr,
    DOT_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[rows, n-tile] for one block of one expert.

    GATHER: row r reads x[tok[r]] (the first projection reads the hidden states in
    token order); else x[r]. FUSED: a second weight (up) accumulated beside the first
    (gate), the GLU applied before the store. HAS_RW: rows scaled by their routing
    weights; SCATTER: row r stored at out_row[r] (the pair's place in token order), so
    the caller only sums the slots. One program per (block, N tile), GROUP_M order."""
    pid_b, pid_n = swizzle(tl.program_id(0), NB, tl.cdiv(N, BN), GROUP_M)
    e = tl.load(blk_expert_ptr + pid_b)
    start = tl.load(blk_start_ptr + pid_b)
    end = tl.load(blk_end_ptr + pid_b)
    if start >= end:
        return
    rows = start + tl.arange(0, BM)
    rmask = rows < end
    src = _rows_at(tok_ptr, rows, rmask, GATHER)
    ns = pid_n * BN + tl.arange(0, BN)
    nmask = ns < N
    acc_a = tl.zeros((BM, BN), dtype=tl.float32)
    acc_b = tl.zeros((BM, BN), dtype=tl.float32)
    a_ptrs = x_ptr + src[:, None] * stride_xm + tl.arange(0, BK)[None, :]
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        a_ptrs += BK
        acc_a = _tile_dot(
            acc_a, a, wa_ptr, sa_ptr, ba_ptr, e, ns, k0, nmask,
            stride_we, stride_wn, stride_se, stride_sn, FORM, BITS, GROUP, BN, BK, DOT_F32,
        )  # fmt: skip
        if FUSED:
            acc_b = _tile_dot(
                acc_b, a, wb_ptr, sb_ptr, bb_ptr, e, ns, k0, nmask,
                stride_we, stride_wn, stride_se, stride_sn, FORM, BITS, GROUP, BN, BK, DOT_F32,
            )  # fmt: skip
    if HAS_BIAS:
        bias_row = e.to(tl.int64) * stride_bias + ns
        acc_a += tl.load(bias_a_ptr + bias_row, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if FUSED:
            acc_b += tl.load(bias_b_ptr + bias_row, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = _glu(acc_a, acc_b, alpha, limit, GLU)
    if HAS_RW:
        y = y * tl.load(rw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    dst = _rows_at(out_row_ptr, rows, rmask, SCATTER)
    ptrs = y_ptr + dst[:, None] * stride_ym + ns[None, :]
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

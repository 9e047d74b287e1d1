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
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..models import moetiles as tt
from ..models.moetiles import INTERPRETED, DeviceProps, Tiles, clamp, smem_estimate, tiles_for
from .dequant import Packed
from .moe import Routing
from .ptxas import ptxas_for

INTERPRET_ENV = "TRITON_INTERPRET"
TILES_ENV = "DISAGG_MOE_TILES"
log = logging.getLogger("disagg.prefill")


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
    if isinstance(w, torch.Tensor) or w.kept is not None:
        plain = w if isinstance(w, torch.Tensor) else w.kept
        assert plain is not None
        if plain.shape[-1] % 16:
            return None
        if plain.stride(-1) != 1:  # strided rows (a view of gate_up) are read in place
            plain = plain.contiguous()
        return Stored(plain, plain, plain, tt.FORM_PLAIN, 16, 1)
    spec = w.spec
    pow2 = spec.group_size & (spec.group_size - 1) == 0
    if w.n_in % 16 or not pow2:
        return None
    if spec.mode == "affine" and spec.bits in (4, 8):
        assert w.biases is not None
        return Stored(w.packed, w.scales, w.biases, tt.FORM_AFFINE, spec.bits, spec.group_size)
    if spec.mode == "mxfp4":
        return Stored(w.packed, w.scales, w.scales, tt.FORM_MXFP4, 4, spec.group_size)
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


@functools.cache  # read per forward: once per device
def device_props(device: torch.device) -> DeviceProps:
    p = torch.cuda.get_device_properties(device)
    shared = getattr(p, "shared_memory_per_block_optin", 0) or 48 << 10
    return DeviceProps((p.major, p.minor), int(shared), p.multi_processor_count,
                       int(getattr(p, "L2_cache_size", 0)))  # fmt: skip


def forced_tiles(props: DeviceProps, kernel: str) -> Tiles | None:
    """DISAGG_MOE_TILES ("bm,bn,bk,warps,stages[,group_m]", powers of two, for sweeps),
    clamped to the device's shared memory with one log line when it is."""
    raw = os.environ.get(TILES_ENV)
    if not raw:
        return None
    try:
        vals = [int(v) for v in raw.split(",")]
        t = Tiles(*vals)
    except (TypeError, ValueError):
        raise ValueError(f"{TILES_ENV}={raw!r}: expected bm,bn,bk,warps,stages[,group_m]") from None
    if any(v < 1 or v & (v - 1) for v in vals[:4]) or min(t.bm, t.bn, t.bk) < 16:
        raise ValueError(f"{TILES_ENV}={raw!r}: bm, bn, bk (>= 16) and warps must be powers of two")
    got = clamp(t, props.shared, kernel)
    if got != t:
        _log_once(f"{TILES_ENV}={raw} needs ~{smem_estimate(t, kernel)} B of shared memory for "
                  f"{kernel}; this device has {props.shared} B: using {got}")  # fmt: skip
    return got


# The interpreter's "device": no shared memory limit to clamp an override to.
INTERPRETER_PROPS = DeviceProps((0, 0), 1 << 30)


def tiles(device: torch.device, pairs: int, experts: int, kernel: str, s: Stored) -> Tiles:
    """tiles_for this device (CUDA), or INTERPRETED under the interpreter; the
    override on either (a sweep's smoke varies the tiles on a CPU)."""
    if device.type != "cuda":
        return forced_tiles(INTERPRETER_PROPS, kernel) or INTERPRETED
    props = device_props(device)
    return forced_tiles(props, kernel) or tiles_for(props, pairs, experts, kernel, s.form, s.group)


@functools.cache
def _log_once(line: str) -> None:
    log.warning("%s", line)


def _glu_code(kind: str, act: Any) -> int | None:
    if kind == "gpt_oss":
        return tt.GLU_GPT_OSS
    silu = act is F.silu or isinstance(act, torch.nn.SiLU)
    return tt.GLU_SWIGLU if silu or type(act).__name__ == "SiLUActivation" else None


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


def describe(w: Packed | torch.Tensor) -> str:
    """A weight's form in a user's words (for the reasons a layer is refused)."""
    if isinstance(w, torch.Tensor):
        return f"plain {str(w.dtype).removeprefix('torch.')}"
    if w.kept is not None:
        return f"kept in {str(w.dtype).removeprefix('torch.')}"
    s = w.spec
    return f"packed {s.mode} {s.bits}-bit, group {s.group_size}"


def refusal(
    kind: str,
    weights: tuple[Packed | torch.Tensor, Packed | torch.Tensor, Packed | torch.Tensor],
    act: Any,
) -> str:
    """Why `prepare` gives None for this layer ("" when the kernels read it)."""
    parts = {}
    for name, w in zip(("gate", "up", "down"), weights, strict=True):
        s = stored(w)
        if s is None:
            return f"{name} is {describe(w)}, a form the fused kernel does not read"
        parts[name] = (s.form, s.bits, s.group)
    if parts["gate"] != parts["up"]:
        return (
            f"gate is {describe(weights[0])} and up {describe(weights[1])}: the fused "
            "kernel reads both in one form"
        )
    if _glu_code(kind, act) is None:
        return f"the fused kernel does not compute {kind}'s activation {act!r}"
    return ""


def prepare(
    kind: str,
    weights: tuple[Packed | torch.Tensor, Packed | torch.Tensor, Packed | torch.Tensor],
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    act: Any,
    alpha: float,
    limit: float,
) -> Experts | None:
    """The layer as the kernels read it, or None if any part is a form they don't
    (`refusal` says which; the caller keeps its own path)."""
    glu = _glu_code(kind, act)
    if glu is None or refusal(kind, weights, act):
        return None
    gate, up, down = (stored(w) for w in weights)
    assert gate is not None and up is not None and down is not None
    if biases is not None:
        biases = (biases[0].contiguous(), biases[1].contiguous(), biases[2].contiguous())
    return Experts(gate, up, down, glu, biases, alpha, limit)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as plain values: what `_launch` runs and what an
    ahead-of-time compile (moe_aot) specializes, so the two cannot drift."""

    grid: tuple[int]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    warps: int
    stages: int


def launch_args(
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
) -> Launch:
    n, kdim = a.n, x.shape[1]
    bk = next(b for b in (t.bk, 32, 16) if kdim % b == 0)  # K is a multiple of 16
    second = b if b is not None else a
    bias_a = bias[0] if bias is not None else y
    bias_b = bias[1] if bias is not None and bias[1] is not None else bias_a
    nb = lay[0].shape[0]
    # The interpreter's bf16 arithmetic is wrong; fp32 (CPU) dots are exact there.
    dot_f32 = interpreted() or x.dtype == torch.float32
    args = (
        x, tokens if tokens is not None else lay[1], x.stride(0),
        a.data, a.scales, a.biases, second.data, second.scales, second.biases,
        bias_a, bias_b, n,
        row_weights if row_weights is not None else y, out_rows if out_rows is not None else lay[1],
        y, y.stride(0),
        lay[0], lay[1], lay[2], nb,
        n, kdim,
        a.data.stride(0), a.data.stride(1), a.scales.stride(0), a.scales.stride(1),
        alpha, limit,
    )  # fmt: skip
    constexprs = dict(
        FORM=a.form, BITS=a.bits, GROUP=a.group,
        GATHER=tokens is not None, FUSED=b is not None, GLU=glu,
        HAS_BIAS=bias is not None, HAS_RW=row_weights is not None, SCATTER=out_rows is not None,
        DOT_F32=dot_f32, BM=t.bm, BN=t.bn, BK=bk, GROUP_M=t.group_m,
    )  # fmt: skip
    return Launch((nb * -(-n // t.bn),), args, constexprs, t.warps, t.stages)


def _launch(*args: Any, **kw: Any) -> None:
    from . import moe_kernels as k

    go = launch_args(*args, **kw)
    k.moe_gemm_kernel[go.grid](*go.args, **go.constexprs, num_warps=go.warps, num_stages=go.stages)


def forward(
    m: Experts, hidden: torch.Tensor, r: Routing, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: the experts' GLU MLPs over the routed pairs, each
    scaled by its routing weight and summed over the slots."""
    t_, k_ = top_k_weights.shape
    hidden = hidden.contiguous()
    dev, s, e = hidden.device, r.pairs, r.num_experts
    t_up, t_down = tiles(dev, s, e, "gate_up", m.gate), tiles(dev, s, e, "down", m.down)
    lay = blocks(r, t_up.bm)
    inter = hidden.new_empty(r.pairs, m.gate.n)
    b = m.biases
    _launch(
        hidden, m.gate, m.up, inter, lay, t_up, tokens=r.tokens, glu=m.glu,
        bias=(b[0], b[1]) if b is not None else None, row_weights=None, out_rows=None,
        alpha=m.alpha, limit=m.limit,
    )  # fmt: skip
    out = hidden.new_empty(t_ * k_, m.down.n)
    rw = top_k_weights.reshape(-1).to(torch.float32)[r.order].contiguous()
    lay = lay if t_down.bm == t_up.bm else blocks(r, t_down.bm)
    _launch(
        inter, m.down, None, out, lay, t_down, tokens=None, glu=0,
        bias=(b[2], None) if b is not None else None, row_weights=rw, out_rows=r.order,
        alpha=m.alpha, limit=m.limit,
    )  # fmt: skip
    return out.view(t_, k_, -1).sum(dim=1)


def warm_tokens(experts: int) -> tuple[int, ...]:
    """Pair counts (one slot per token) that reach every band of rows per expert."""
    return (1, 16 * experts, 64 * experts)


def warm(m: Experts, device: torch.device, experts: int, dtype: torch.dtype) -> str | None:
    """Compile the kernels at every tile set `device` picks for this layer's forms, by
    one forward over dummy rows per distinct set (once per process and form); the
    failure as one line, or None. A GPU whose Triton cannot build them (e.g. a
    ptxas without sm_121a: TRITON_PTXAS_PATH) then keeps the torch paths."""
    return _warm(_WarmKey.of(m, device, experts, dtype), m)


@dataclass(frozen=True)
class _WarmKey:
    device: torch.device
    experts: int
    dtype: torch.dtype
    forms: tuple[tuple[int, int, int, int, int], ...]
    glu: int
    biased: bool

    @staticmethod
    def of(m: Experts, device: torch.device, experts: int, dtype: torch.dtype) -> _WarmKey:
        forms = tuple((s.form, s.bits, s.group, s.n, s.data.shape[-1]) for s in (m.gate, m.down))
        return _WarmKey(device, experts, dtype, forms, m.glu, m.biases is not None)


_warmed: dict[_WarmKey, str | None] = {}


def _warm(key: _WarmKey, m: Experts) -> str | None:
    from .moe import route

    if key in _warmed:
        return _warmed[key]
    if key.device.type == "cuda":
        line = ptxas_for(torch.cuda.get_device_capability(key.device))  # before compiling
        if line:
            _log_once(line)
    err = None
    seen: set[tuple[Tiles, Tiles]] = set()
    try:
        for pairs in warm_tokens(key.experts):
            dev, e = key.device, key.experts
            pick = (tiles(dev, pairs, e, "gate_up", m.gate), tiles(dev, pairs, e, "down", m.down))
            if pick in seen:
                continue
            seen.add(pick)
            idx = (torch.arange(pairs, device=dev) % e).reshape(-1, 1)
            hidden = torch.zeros(pairs, m.down.n, device=dev, dtype=key.dtype)
            w = torch.ones(pairs, 1, device=dev, dtype=key.dtype)
            forward(m, hidden, route(idx, e), w)
    except Exception as exc:  # a compile error of any kind: the layer keeps torch's paths
        err = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    _warmed[key] = err
    return err


def fell_back(device: torch.device, err: str, path: str) -> None:
    """The one log line for a device whose kernels did not compile."""
    _log_once(f"MoE: the Triton kernels did not compile on {device} ({err}); "
              f"MoE layers take the {path} path")  # fmt: skip

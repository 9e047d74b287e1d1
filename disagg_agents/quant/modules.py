"""torch modules that hold weights packed and dequantize them just in time, or
hold them dequantized once at load where memory allows (`Packed.keep`).

Each forward call of a layer covers the whole prompt, so a packed weight is
dequantized once per prefill, not per token; the full-precision copy lives only
during that call. MoE experts dequantize all experts of a layer in one batched
op (or, for fewer (token, slot) pairs than experts, only the routed ones) and
run as grouped GEMMs with no host sync (disagg_agents.quant.moe).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import moe, moe_triton
from .dequant import Packed

# A dequantized chunk of a big matrix (the LM head) stays under this many elements,
# so the head never costs more memory than a layer.
CHUNK_ELEMENTS = 1 << 21

Weight = Packed | torch.Tensor  # an expert projection may be left unquantized


class QuantLinear(nn.Module):
    """nn.Linear whose weight [out, in] stays packed (or was kept dequantized)."""

    def __init__(self, packed: Packed, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.n_in, packed.shape[0]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(1, CHUNK_ELEMENTS // self.in_features)
        if rows >= self.out_features or self.packed.kept is not None:
            return F.linear(x, self.packed.full(), self.bias)
        parts = []
        for start in range(0, self.out_features, rows):
            sl = slice(start, min(start + rows, self.out_features))
            b = self.bias[sl] if self.bias is not None else None
            parts.append(F.linear(x, self.packed.rows(sl), b))
        return torch.cat(parts, dim=-1)


class QuantEmbedding(nn.Module):
    """nn.Embedding whose table stays packed: only the looked-up rows are dequantized."""

    def __init__(self, packed: Packed) -> None:
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed.kept is not None:
            return F.embedding(ids, self.packed.kept)
        # Each looked-up row dequantized (a repeated id twice): no `unique`, a host sync.
        return self.packed.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


class PackedWeightHook:
    """For modules that use `self.weight` in their own forward (MoE routers): the
    weight is dequantized before each call and dropped after it."""

    def __init__(self, module: nn.Module, packed: Packed) -> None:
        self.packed = packed
        if "weight" in module._parameters:
            del module._parameters["weight"]
        module.__dict__["weight"] = None
        module.__dict__["packed"] = packed  # for inspection (tests compare it with mlx)
        module.register_forward_pre_hook(self.before)
        module.register_forward_hook(self.after)

    def before(self, module: nn.Module, args: Any) -> None:
        module.__dict__["weight"] = self.packed.full()

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        module.__dict__["weight"] = None


def _full(w: Weight) -> torch.Tensor:
    return w.full() if isinstance(w, Packed) else w


def _take(w: Weight) -> moe.Take:
    return w.rows if isinstance(w, Packed) else lambda idx: w.index_select(0, idx)


def _kept(w: Weight) -> bool:
    return not isinstance(w, Packed) or w.kept is not None


class PackedExperts(nn.Module):
    """Stacked experts as mlx keeps them: gate/up [E, I, hidden], down [E, hidden, I]
    (Linear orientation), with optional biases [E, out]. Computes the transformers
    module it replaces (same call signature): qwen3_moe SwiGLU, or gpt_oss' clamped
    GLU with alpha and limit, for all tokens at once (disagg_agents.quant.moe)."""

    def __init__(
        self,
        kind: str,
        gate: Weight,
        up: Weight,
        down: Weight,
        num_experts: int,
        dtype: torch.dtype,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        act: Any = None,
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.kind, self.num_experts, self.dtype = kind, num_experts, dtype
        self.gate, self.up, self.down = gate, up, down
        for name, w in (("gate_w", gate), ("up_w", up), ("down_w", down)):
            if isinstance(w, torch.Tensor):
                self.register_buffer(name, w, persistent=False)
        self.biases = biases
        self.act = act
        self.alpha, self.limit = alpha, limit
        self._triton: moe_triton.Experts | bool | None = None  # made on first use

    def _fused(self, device: torch.device) -> moe_triton.Experts | None:
        """The layer as the Triton kernels read it (made once), or None where they
        cannot run or do not read these weights' form."""
        if not moe_triton.available(device):
            return None
        if self._triton is None:
            weights = (self.gate, self.up, self.down)
            fused = moe_triton.prepare(
                self.kind, weights, self.biases, self.act, self.alpha, self.limit
            )
            err = fused and moe_triton.warm(fused, device, self.num_experts, self.dtype)
            if err:  # compiled once per process and form; said once
                path = "grouped" if moe.grouped_mm_fits(device, self.dtype) else "blocked"
                moe_triton.fell_back(device, err, path)
            self._triton = fused if fused and not err else False
        return self._triton if isinstance(self._triton, moe_triton.Experts) else None

    @property
    def fell_back(self) -> bool:
        """The fused kernels were tried for this layer and refused or failed to compile."""
        return self._triton is False

    def path(self, device: torch.device) -> str:
        """ "triton" where this layer runs the fused kernels on `device` (compiled
        there), else "torch" (grouped or blocked, chosen per call)."""
        return "triton" if self._fused(device) is not None else "torch"

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "gpt_oss":  # GptOssExperts._apply_gate
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return self.act(gate) * up

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        r = moe.route(top_k_index, self.num_experts)
        kept = all(_kept(w) for w in (self.gate, self.up, self.down))
        fused = self._fused(hidden.device)
        gemm, block = moe.pick_gemm(hidden, self.dtype, kept, r, fused is not None)
        if gemm == "triton":
            assert fused is not None
            return moe_triton.forward(fused, hidden, r, top_k_weights).to(hidden.dtype)
        x = hidden.index_select(0, r.tokens)  # [S, hidden], rows grouped by expert
        layout = moe.blocked_layout(r, block) if gemm == "blocked" else None

        def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
            if layout is None:
                return moe.grouped_linear(x, _full(w), r)
            return moe.blocked_linear(x, _take(w), layout, block)

        g, u = linear(x, self.gate), linear(x, self.up)
        if self.biases is not None:
            g, u = g + self.biases[0][r.experts], u + self.biases[1][r.experts]
        y = linear(self._glu(g, u), self.down)
        if self.biases is not None:
            y = y + self.biases[2][r.experts]
        return moe.combine(y, r, top_k_weights, hidden.dtype)


def warm_experts(model: nn.Module, device: torch.device) -> dict[str, int]:
    """Compile the MoE kernels for every PackedExperts layer now (at load, not in the
    first prefill); how many layers take each path ("triton", "torch")."""
    paths: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, PackedExperts):
            p = mod.path(device)
            paths[p] = paths.get(p, 0) + 1
    return paths


def plain_experts(model: nn.Module, kind: str, device: torch.device, dtype: torch.dtype) -> int:
    """For a full-precision checkpoint: transformers' qwen3_moe experts replaced by
    PackedExperts over the same tensors (views, no copy) where the Triton kernels
    would run (CUDA without torch's fast grouped_mm, e.g. the Spark's sm_121, where
    transformers' grouped_mm falls back to a host loop; or DISAGG_MOE_GEMM=triton).
    Returns the layers replaced."""
    import os

    want = os.environ.get(moe.GEMM_ENV, "auto")
    if kind != "qwen3_moe" or not moe_triton.available(device):
        return 0
    if want != "triton" and (want != "auto" or moe.grouped_mm_fits(device, dtype)):
        return 0
    swapped = 0
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ != "Qwen3MoeExperts":
            continue
        inter = mod.down_proj.shape[-1]
        gate_up = mod.gate_up_proj.detach()
        new = PackedExperts(
            kind, gate_up[:, :inter], gate_up[:, inter:], mod.down_proj.detach(),
            mod.num_experts, dtype, None, act=mod.act_fn,
        )  # fmt: skip
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
        swapped += 1
    return swapped


def materialize(model: nn.Module) -> int:
    """Dequantize every packed weight of `model` in place, for good (what loading
    a dequantized copy would give). For comparisons: packed vs dequantized at load.
    Returns the bytes of the full-precision weights made."""
    made = 0
    memo: dict[int, torch.Tensor] = {}  # a tied head shares its embedding's tensor

    def full(p: Packed) -> torch.Tensor:
        nonlocal made
        if id(p) not in memo:
            memo[id(p)] = p.full()
            made += memo[id(p)].nbytes
        return memo[id(p)]

    for name, mod in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if name else None
        new: nn.Module | None = None
        if isinstance(mod, QuantLinear):
            w = full(mod.packed)
            new = nn.Linear(w.shape[1], w.shape[0], bias=mod.bias is not None, device="meta")
            new.weight = nn.Parameter(w, requires_grad=False)
            if mod.bias is not None:
                new.bias = mod.bias
        elif isinstance(mod, QuantEmbedding):
            w = full(mod.packed)
            new = nn.Embedding(w.shape[0], w.shape[1], device="meta")
            new.weight = nn.Parameter(w, requires_grad=False)
        elif isinstance(mod, PackedExperts):
            for attr in ("gate", "up", "down"):
                p = getattr(mod, attr)
                if isinstance(p, Packed):
                    setattr(mod, attr, full(p))
            mod._triton = None  # the kernels' view of the weights, made anew
        elif isinstance(mod.__dict__.get("packed"), Packed):  # a hooked router
            w = full(mod.__dict__.pop("packed"))
            mod._forward_pre_hooks.clear()
            mod._forward_hooks.clear()
            del mod.__dict__["weight"]
            mod.weight = nn.Parameter(w, requires_grad=False)
        if new is not None and parent is not None:
            setattr(parent, leaf, new)
    return made

"""Which grouped GEMM each MoE layer takes on a device, named at load.

The path a layer takes is decided per forward (`moe.pick_gemm`), from the device
and the weights' form: a layer whose weights the fused kernel cannot read falls
back to the grouped or blocked path without a word. Here the same decision is
made once at load, for a long prompt (more pairs than experts), from the device's
facts given as plain values (so a CPU test can ask what a GB10 would do), and a
layer on a slower path than the device's best says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagg_agents.wire.status import MoePath

from . import moe_triton
from .dequant import Packed
from .modules import PackedExperts, Weight

log = logging.getLogger("disagg.prefill")


@dataclass(frozen=True)
class DeviceFacts:
    """What the MoE path depends on: the device type, its CUDA compute capability,
    and whether the Triton kernels run there."""

    type: str  # cuda | cpu | mps
    capability: tuple[int, int] | None = None
    triton: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceFacts:
        dev = torch.device(device)
        cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        return cls(dev.type, cap, dev.type == "cuda" and moe_triton.available(dev))

    @property
    def fused(self) -> bool:
        """The fused kernel is this device's MoE path (CUDA with Triton)."""
        return self.type == "cuda" and self.triton

    def grouped_fast(self, dtype: torch.dtype) -> bool:
        """`grouped_mm` runs without a host loop (as moe.grouped_mm_fits)."""
        if not hasattr(F, "grouped_mm"):
            return False
        if self.type == "cpu":
            return dtype in (torch.float32, torch.bfloat16, torch.float16)
        if self.type == "cuda" and self.capability is not None:
            return dtype == torch.bfloat16 and self.capability[0] in (9, 10)
        return False


def best_path(dev: DeviceFacts, dtype: torch.dtype) -> str:
    if dev.fused:
        return "triton"
    return "grouped" if dev.grouped_fast(dtype) else "blocked"


def _kept(w: Weight) -> bool:
    return not isinstance(w, Packed) or w.kept is not None


def refusal(mod: PackedExperts) -> str:
    """Why the fused kernel does not read this layer ("" when it does)."""
    return moe_triton.refusal(mod.kind, (mod.gate, mod.up, mod.down), mod.act)


def layer_path(index: int, mod: PackedExperts, dev: DeviceFacts) -> MoePath:
    """The path `mod` takes for a long prompt on `dev`, as `moe.pick_gemm` picks it."""
    best = best_path(dev, mod.dtype)
    kept = all(_kept(w) for w in (mod.gate, mod.up, mod.down))
    grouped = dev.grouped_fast(mod.dtype)
    if dev.fused:
        why = refusal(mod) or (
            "its kernels failed to compile at load (the log says why)" if mod.fell_back else ""
        )
        if not why:  # kept bf16 where grouped_mm's fast kernel runs: as fast (measured)
            return MoePath(index, "grouped" if kept and grouped else "triton", best)
        return MoePath(index, "grouped" if grouped else "blocked", best, why)
    path = "grouped" if grouped else "blocked"
    return MoePath(index, path, best, "" if path == best else "grouped_mm loops on the host")


def layer_index(name: str) -> int:
    """The decoder layer's index in a module path ("model.layers.3.mlp.experts" -> 3)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return -1


def moe_paths(model: nn.Module, dev: DeviceFacts) -> list[MoePath]:
    """Each PackedExperts layer of `model` with the path it takes on `dev`."""
    return [
        layer_path(layer_index(name), mod, dev)
        for name, mod in model.named_modules()
        if isinstance(mod, PackedExperts)
    ]


def log_slow(paths: list[MoePath]) -> list[str]:
    """One log line per reason a layer is on a slower path than the device's best,
    naming its layers; returns the lines."""
    slow: dict[tuple[str, str, str], list[int]] = {}
    for p in paths:
        if p.reason:
            slow.setdefault((p.path, p.best, p.reason), []).append(p.layer)
    lines = []
    for (path, best, reason), layers in slow.items():
        lines.append(
            f"MoE layers {', '.join(map(str, layers))}: the {path} path, not {best}: {reason}"
        )
        log.warning("%s", lines[-1])
    return lines

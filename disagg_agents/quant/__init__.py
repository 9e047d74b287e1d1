"""Quantized checkpoints: formats, refusals and weight identity (no torch, no mlx
here); `dequant`, `modules`, `moe`, `budget` and `loader` are the prefill side's
torch code."""

from __future__ import annotations

from .formats import (
    check_supported,
    is_quantized,
    mlx_quantization,
    quant_summary,
    weights_identity,
    weights_mismatch,
)

__all__ = [
    "check_supported",
    "is_quantized",
    "mlx_quantization",
    "quant_summary",
    "weights_identity",
    "weights_mismatch",
]

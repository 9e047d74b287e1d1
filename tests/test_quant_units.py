"""Dequantization against mlx itself, and the one-line refusals (no model loads)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from disagg_agents.models import UnsupportedModel
from disagg_agents.quant import check_supported, weights_mismatch
from disagg_agents.quant.dequant import FP_MODES, Packed, QSpec
from tests.quantmodels import mxfp4_quantize

DTYPES = {
    "float32": (mx.float32, torch.float32),
    "bfloat16": (mx.bfloat16, torch.bfloat16),
    "float16": (mx.float16, torch.float16),
}


def to_torch(a: mx.array) -> torch.Tensor:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: move the raw 16-bit words
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (so -0.0 != 0.0 and NaN == NaN)."""
    ints = {4: torch.int32, 2: torch.int16}
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(ints[a.element_size()]), b.contiguous().view(ints[b.element_size()])
    )


def weights(shape: tuple[int, ...]) -> mx.array:
    mx.random.seed(7)
    return mx.random.normal(shape) * 2.5


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_affine_dequant_is_bit_identical_to_mx(dtype: str, bits: int, group: int) -> None:
    mxt, tt = DTYPES[dtype]
    w = weights((3, 40, 384)).astype(mxt)  # stacked like MoE experts
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    ref = mx.dequantize(wq, scales, biases, group_size=group, bits=bits)
    p = Packed(
        to_torch(wq), to_torch(scales), to_torch(biases), QSpec("affine", bits, group), 384, tt
    )
    assert same_bits(p.full(), to_torch(ref))
    assert same_bits(p.expert(1), to_torch(ref[1]))
    rows = torch.tensor([5, 0, 39])
    table = Packed(to_torch(wq[0]), to_torch(scales[0]), to_torch(biases[0]), p.spec, 384, tt)
    assert same_bits(table.rows(rows), to_torch(ref[0][mx.array([5, 0, 39])]))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", list(FP_MODES))
def test_fp_modes_dequant_is_bit_identical_to_mx(dtype: str, mode: str) -> None:
    mxt, tt = DTYPES[dtype]
    wq, scales, *_ = mx.quantize(weights((40, 256)).astype(mxt), mode=mode)
    ref = mx.dequantize(wq, scales, mode=mode, dtype=mxt)
    bits, group = FP_MODES[mode]
    p = Packed(to_torch(wq), to_torch(scales), None, QSpec(mode, bits, group), 256, tt)
    assert same_bits(p.full(), to_torch(ref))


def test_openai_mxfp4_blocks_from_the_test_helper_read_as_mlx_reads_them() -> None:
    """The helper's blocks/scales, viewed as mlx-lm's sanitize views them, dequantize
    in mlx to what torch reads, and are a faithful MXFP4 of the weights."""
    w = np.array(weights((2, 24, 128)))
    blocks, scales = mxfp4_quantize(w)  # [E, out, G, 16], [E, out, G]
    words = mx.array(blocks).view(mx.uint32).flatten(-2)
    ref = mx.dequantize(words, mx.array(scales), mode="mxfp4", dtype=mx.float32)
    p = Packed(
        torch.from_numpy(blocks.reshape(2, 24, -1)),
        torch.from_numpy(scales),
        None,
        QSpec("mxfp4", 4, 32),
        128,
        torch.float32,
    )
    assert same_bits(p.full(), to_torch(ref))
    err = np.abs(np.array(ref) - w) / (np.abs(w).max(axis=-1, keepdims=True))
    assert err.max() <= 0.25  # half the largest E2M1 step at the group's scale


def _dir(
    tmp_path: Path, cfg: dict[str, object], files: tuple[str, ...] = ("model.safetensors",)
) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
    for f in files:
        # A well-formed safetensors file holding no tensors (an 8-byte length, then "{}").
        (d / f).write_bytes(struct.pack("<Q", 2) + b"{}")
    return d


@pytest.mark.parametrize(
    ("cfg", "files", "found"),
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, (), "GPTQ"),
        ({"quantization_config": {"quant_method": "awq"}}, (), "AWQ"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, (), "bitsandbytes"),
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, (), "NVFP4"),
        ({}, ("hf_quant_config.json",), "ModelOpt"),
        ({"quantization": {"bits": 7, "group_size": 64}}, (), "affine 7-bit"),
        ({"quantization": {"bits": 4, "group_size": 64, "mode": "int4x"}}, (), "'int4x'"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, (), "HF MXFP4 llama"),
    ],
)
def test_unsupported_formats_get_one_line_naming_the_format_and_the_fix(
    tmp_path: Path, cfg: dict[str, object], files: tuple[str, ...], found: str
) -> None:
    d = _dir(tmp_path, cfg, ("model.safetensors", *files))
    with pytest.raises(UnsupportedModel) as info:
        check_supported(d)
    msg = str(info.value)
    assert "\n" not in msg and found in msg
    assert "supported:" in msg and "mlx_lm.convert --hf-path" in msg and str(d) in msg


def test_gguf_is_refused_as_a_file_or_a_dir(tmp_path: Path) -> None:
    f = tmp_path / "model.Q4_1.gguf"
    f.write_bytes(b"GGUF")
    for path in (f, tmp_path):
        with pytest.raises(UnsupportedModel, match="GGUF.*mlx_lm.convert"):
            check_supported(path)


def test_supported_configs_pass(tmp_path: Path) -> None:
    check_supported(
        _dir(
            tmp_path,
            {
                "quantization": {
                    "bits": 4,
                    "group_size": 64,
                    "mode": "affine",
                    "model.layers.0.mlp.gate": {"bits": 8, "group_size": 64},
                }
            },
        )
    )


def test_weights_mismatch_names_both_sides_and_the_fix() -> None:
    a = {"weights": {"quantization": None, "digest": "aaaa"}}
    b = {
        "weights": {
            "quantization": {"mode": "affine", "bits": 4, "group_size": 64},
            "digest": "bbbb",
        }
    }
    assert weights_mismatch(a, dict(a), "/m/fp", "/m/fp") is None
    line = weights_mismatch(a, b, "/m/fp", "/m/q4") or ""
    assert "\n" not in line
    for part in (
        "/m/fp",
        "/m/q4",
        "full precision",
        "4-bit affine g64",
        "mixed_weights = true",
        "--allow-mixed",
    ):
        assert part in line

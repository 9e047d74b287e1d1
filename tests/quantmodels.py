"""Quantized checkpoints for the tests, written once per machine into a cache keyed by
a digest of the code that writes them (see checkpoint_cache), so a changed helper never
leaves a stale checkpoint behind.

MLX dirs come from mlx-lm's own `mlx_lm.convert` (as a user makes them); the
OpenAI-layout MXFP4 gpt-oss is written here from a tiny random gpt_oss by
`mxfp4_quantize`, which follows the OCP MX spec (E2M1 values, E8M0 scale per 32).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from disagg.bench.quantize import publish
from disagg.serving.defaultmodel import cache_root, ensure_default_model
from tests import tinymodels
from tests.tinymodels import make_tiny

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)

# name -> (source, convert kwargs); sources: "smol" (the default model) or a tiny arch.
MLX_DIRS: dict[str, tuple[str, dict[str, Any]]] = {
    "smol-affine4": ("smol", {"q_bits": 4, "q_group_size": 64}),
    "smol-affine8": ("smol", {"q_bits": 8, "q_group_size": 64}),
    "smol-mxfp4": ("smol", {"q_mode": "mxfp4"}),
    # moe_intermediate_size is 32: group 32 quantizes every expert; mlx-lm keeps
    # the router mlp.gate at 8 bits, group 64 (its qwen3_moe quant_predicate).
    "moe-affine4": ("qwen3_moe", {"q_bits": 4, "q_group_size": 32}),
}


# Every checkpoint the tests run end to end.
DIRS = ["smol-affine4", "smol-affine8", "smol-mxfp4", "moe-affine4", "gptoss-hf-mxfp4"]

# Tiny MoE sources with the user's models' expert counts (routing, not width):
# name -> (arch, config overrides). Qwen3-Coder-30B-A3B routes to 8 of 128 experts,
# GPT-OSS-120B to 4 of 128.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe-e32": ("qwen3_moe", {"num_experts": 32, "num_experts_per_tok": 8}),
    "qwen3_moe-e128": ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8}),
    "gpt_oss-e32": ("gpt_oss", {"num_local_experts": 32, "num_experts_per_tok": 4}),
    "gpt_oss-e128": ("gpt_oss", {"num_local_experts": 128, "num_experts_per_tok": 4}),
}
for _e in (32, 128):
    MLX_DIRS[f"moe{_e}-affine4"] = (f"qwen3_moe-e{_e}", {"q_bits": 4, "q_group_size": 32})


@cache
def checkpoint_cache() -> Path:
    """$DISAGG_CACHE/test-checkpoints/<digest>: the digest covers what writes the
    checkpoints (this file, tinymodels.py, the adapters' mlx_config in disagg_agents/models)
    and the versions of mlx-lm and transformers that convert and save them."""
    import mlx_lm
    import transformers

    import disagg_agents.models

    h = hashlib.sha256(f"{mlx_lm.__version__} {transformers.__version__}".encode())
    models = Path(disagg_agents.models.__file__).parent
    for f in [Path(__file__), Path(tinymodels.__file__), *sorted(models.glob("*.py"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return cache_root() / "test-checkpoints" / h.hexdigest()[:16]


def tiny_source(name: str) -> Path:
    """A tiny random checkpoint (an architecture, or one of VARIANTS) with the config
    keys mlx-lm needs (as a real HF config has them), so that mlx_lm.convert can read it."""
    from disagg_agents.models import get_adapter

    arch, overrides = VARIANTS.get(name, (name, {}))

    def build(dst: Path) -> None:
        make_tiny(arch, dst, seed=3, **overrides)
        cfg_path = dst / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(get_adapter(arch).mlx_config(cfg))
        cfg_path.write_text(json.dumps(cfg, indent=2))

    return publish(build, checkpoint_cache() / f"tiny-{name}")


# OpenAI-layout MXFP4 gpt-oss dirs -> their tiny source.
HF_MXFP4 = {"gptoss-hf-mxfp4": "gpt_oss", "gptoss32-hf-mxfp4": "gpt_oss-e32"}
HF_MXFP4["gptoss128-hf-mxfp4"] = "gpt_oss-e128"


def quant_dir(name: str) -> Path:
    """The cached checkpoint `name` (see MLX_DIRS and HF_MXFP4)."""
    if name in HF_MXFP4:
        return publish(
            lambda dst: write_hf_mxfp4_gptoss(tiny_source(HF_MXFP4[name]), dst),
            checkpoint_cache() / name,
        )
    source, kwargs = MLX_DIRS[name]
    src = ensure_default_model() if source == "smol" else tiny_source(source)

    def convert(dst: Path) -> None:
        import mlx_lm

        mlx_lm.convert(hf_path=str(src), mlx_path=str(dst), quantize=True, **kwargs)

    return publish(convert, checkpoint_cache() / name)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] float -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]).

    OCP MX: per block of 32, shared scale 2^(floor(log2(amax)) - 2) (E2M1's largest
    exponent is 2), stored as E8M0 (e + 127); elements rounded to the nearest E2M1
    value (ties to even code), saturating at 6; two per byte, low nibble first.
    """
    *lead, out, n_in = w.shape
    g = w.astype(np.float64).reshape(*lead, out, n_in // 32, 32)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127)
    exp = np.clip(exp, -127, 127)
    x = g / np.exp2(exp)
    mag = np.minimum(np.abs(x), 6.0)
    dist = np.abs(mag[..., None] - E2M1_MAGNITUDES)
    code = dist.argmin(axis=-1)  # argmin takes the lower (even) code on a tie
    code = code | np.where(np.signbit(x), 8, 0)
    code = code.astype(np.uint8).reshape(*lead, out, n_in // 32, 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    scales = (exp[..., 0] + 127).astype(np.uint8)
    return blocks, scales


def write_hf_mxfp4_gptoss(src: Path, dst: Path) -> Path:
    """OpenAI's gpt-oss checkpoint layout from a transformers-saved gpt_oss: experts
    as `{gate_up,down}_proj_{blocks,scales}` in Linear orientation [E, out, ...]
    (gate/up interleaved by rows), biases as `*_proj_bias`, the rest as is."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            # transformers keeps x @ W ([E, in, out]); OpenAI stores [E, out, in].
            blocks, scales = mxfp4_quantize(np.ascontiguousarray(np.swapaxes(t, -1, -2)))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst

"""What every architecture shares: config reading and the generic mlx fixes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np


class UnsupportedModel(Exception):
    """The model dir is missing, unreadable, or of an architecture we lack."""


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise UnsupportedModel(f"model dir {path} does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModel(f"{path} has no config.json: not a Hugging Face model dir")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError, bad UTF-8, 4300+ digit ints
        raise UnsupportedModel(f"cannot read {cfg_path}: {e}") from None
    except RecursionError:
        raise UnsupportedModel(f"cannot read {cfg_path}: nested too deeply") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UnsupportedModel(f"{cfg_path} has no model_type")
    return cfg


def hf_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters as transformers 5 reads them, from either config layout."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = dict(rope) if isinstance(rope, dict) else {}
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "rope_theta" not in rope and cfg.get("rope_theta") is not None:
        rope["rope_theta"] = cfg["rope_theta"]
    return rope


def yarn_inv_freq(
    rope: dict[str, Any], dim: int, max_position_embeddings: int | None
) -> tuple[np.ndarray, float]:
    """transformers' YaRN (`_compute_yarn_parameters`): inverse frequencies and the
    attention factor it multiplies cos/sin with, honouring `truncate`."""
    base = float(rope["rope_theta"])
    factor = rope.get("factor")
    orig = int(rope["original_max_position_embeddings"])
    if factor is None:
        factor = (max_position_embeddings or orig) / orig
    factor = float(factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def layer_kinds_from_hf(cfg: dict[str, Any]) -> list[list[Any]]:
    """Per layer [kind, window] as transformers will cache it."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["full_attention"] * n
    window = cfg.get("sliding_window")
    return [
        ["sliding", int(window)] if t == "sliding_attention" and window else ["full", 0]
        for t in types
    ]


class Adapter:
    """Defaults fit llama-like models; subclasses override what differs."""

    model_type = ""

    def mlx_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Config overrides for mlx-lm, which predates transformers 5's key names."""
        out: dict[str, Any] = {}
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict):
            # transformers 5 nests rope_theta; mlx-lm reads it at the top level and
            # silently falls back to 10000 without it.
            if "rope_theta" not in cfg and "rope_theta" in rope:
                out["rope_theta"] = rope["rope_theta"]
            kind = rope.get("rope_type", "default")
            if kind != "default" and not cfg.get("rope_scaling"):
                out["rope_scaling"] = {**rope, "type": kind}
        return out

    def mlx_weights(self, weights: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
        """Rename or relayout HF tensors before mlx-lm's own sanitize runs."""
        return weights

    def patch_mlx_model(self, model: Any, cfg: dict[str, Any]) -> None:
        """Last fixes on the built mlx model, e.g. RoPE that mlx-lm computes differently."""
        rope = hf_rope_parameters(cfg)
        if rope["rope_type"] == "yarn":
            self._use_hf_yarn(model, cfg, rope)

    def _use_hf_yarn(self, model: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
        """Make every RoPE module of the mlx model compute transformers' YaRN.

        mlx-lm's YarnRoPE always floors/ceils the correction range (transformers
        skips that when `truncate` is false, as gpt-oss says), ignores
        `attention_factor`, and some mlx-lm models (qwen3_moe) build a plain RoPE
        whatever the config says. The checkpoint is the truth: take its numbers.
        """
        import mlx.core as mx
        from mlx_lm.models.rope_utils import YarnRoPE

        max_pos = cfg.get("max_position_embeddings")
        patched = 0
        for _, mod in model.named_modules():
            old = getattr(mod, "rope", None)
            if old is None or not hasattr(old, "dims"):
                continue
            if not isinstance(old, YarnRoPE):
                mod.rope = YarnRoPE(
                    old.dims,
                    traditional=bool(getattr(old, "traditional", False)),
                    base=float(rope["rope_theta"]),
                )
            inv_freq, attention_factor = yarn_inv_freq(rope, int(mod.rope.dims), max_pos)
            mod.rope._freqs = mx.array((1.0 / inv_freq.astype(np.float64)).astype(np.float32))
            mod.rope.mscale = attention_factor
            patched += 1
        if not patched:
            raise UnsupportedModel("the config asks for YaRN RoPE but the mlx model has no RoPE")

    def head_dim(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    def num_kv_heads(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])

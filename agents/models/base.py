"""What every architecture shares: config reading and the generic mlx fixes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModel(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UnsupportedModel(f"{cfg_path} has no model_type")
    return cfg


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

    def head_dim(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    def num_kv_heads(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])

from typing import Any

from .base import Adapter, UnsupportedModel, hf_rope_parameters


class Qwen3MoeAdapter(Adapter):
    model_type = "qwen3_moe"

    def mlx_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        out = super().mlx_config(cfg)
        # transformers 5 renamed num_experts to num_local_experts; mlx-lm requires
        # num_experts (a ModelArgs field without default: the load fails without it).
        if "num_experts" not in cfg and "num_local_experts" in cfg:
            out["num_experts"] = cfg["num_local_experts"]
        # mlx-lm's qwen3_moe builds a plain RoPE whatever rope_scaling says. YaRN is
        # put right by patch_mlx_model; any other scaling would silently differ.
        kind = hf_rope_parameters(cfg)["rope_type"]
        if kind not in ("default", "yarn"):
            raise UnsupportedModel(
                f"qwen3_moe with rope_type {kind!r}: mlx-lm would ignore it and decode "
                "with a different RoPE than the prefill side"
            )
        return out

from typing import Any

from .base import Adapter


class Qwen3MoeAdapter(Adapter):
    model_type = "qwen3_moe"

    def mlx_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        out = super().mlx_config(cfg)
        # transformers 5 renamed num_experts to num_local_experts.
        if "num_experts" not in cfg and "num_local_experts" in cfg:
            out["num_experts"] = cfg["num_local_experts"]
        return out

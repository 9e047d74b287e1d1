"""Per-architecture adapters: what torch and mlx need to compute one function.

Each adapter is pure config/weight surgery; it knows tensors by name, not sockets.
"""

from __future__ import annotations

from .base import Adapter, UnsupportedModel, layer_kinds_from_hf, load_hf_config
from .gpt_oss import GptOssAdapter
from .llama import LlamaAdapter
from .qwen3 import Qwen3Adapter
from .qwen3_moe import Qwen3MoeAdapter

ADAPTERS: dict[str, Adapter] = {
    a.model_type: a for a in (LlamaAdapter(), Qwen3Adapter(), Qwen3MoeAdapter(), GptOssAdapter())
}


def get_adapter(model_type: str) -> Adapter:
    try:
        return ADAPTERS[model_type]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedModel(
            f"architecture {model_type!r} is not supported (supported: {supported})"
        ) from None


__all__ = [
    "ADAPTERS",
    "Adapter",
    "UnsupportedModel",
    "get_adapter",
    "layer_kinds_from_hf",
    "load_hf_config",
]

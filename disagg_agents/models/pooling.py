"""How a checkpoint pools its hidden states into one embedding, read from its files.

sentence-transformers' layout: `modules.json` names a Pooling module and its
folder (`1_Pooling/config.json`: last token, CLS, max or mean). Qwen3-Embedding-
style checkpoints carry it as last-token. A checkpoint that declares one is an
embedding model (Ollama's `embedding` capability); any other is pooled by mean
when asked for embeddings. Torch-free: the decode agent reads it for /api/show.
"""

from __future__ import annotations

import json
from pathlib import Path

POOLINGS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
}


def pooling_config(model_dir: str | Path) -> Path | None:
    """The checkpoint's Pooling config file, where it declares one."""
    d = Path(model_dir)
    config = d / "1_Pooling" / "config.json"
    try:
        for module in json.loads((d / "modules.json").read_text()):
            if str(module.get("type", "")).endswith("Pooling"):
                config = d / str(module.get("path", "1_Pooling")) / "config.json"
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return config if config.is_file() else None


def pooling_of(model_dir: str | Path) -> str:
    """The checkpoint's pooling: its declared one where it has it, else mean."""
    config = pooling_config(model_dir)
    try:
        cfg = json.loads(config.read_text()) if config is not None else {}
    except (OSError, ValueError):
        return "mean"
    if not isinstance(cfg, dict):
        return "mean"
    return next((name for key, name in POOLINGS.items() if cfg.get(key)), "mean")

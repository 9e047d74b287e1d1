"""A seeded random checkpoint in a real model's shape, for timing hardware where no
trained weights can be fetched (the GPU machines lent here reach no hub).

Speed depends on the shape, not the values: the shapes are published configs, the
tokenizer is the embedded default's (the same family, so prompts tokenize alike).

Run: python -m disagg.bench.randommodel OUT --tokenizer DIR [--shape smollm2-360m]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from disagg.serving.defaultmodel import rope_theta_for_mlx

# Published llama-family shapes sharing SmolLM2's 49,152-token vocabulary.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-360m": dict(
        hidden_size=960,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        intermediate_size=2560,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make(out_dir: Path, tokenizer_dir: Path, shape: str, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    config = LlamaConfig(
        **SHAPES[shape],
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    rope_theta_for_mlx(out_dir)  # or mlx-lm's reference computes another model
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="dir with tokenizer.json")
    ap.add_argument("--shape", default="smollm2-360m", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make(args.out, args.tokenizer, args.shape, args.seed))


if __name__ == "__main__":
    main()

"""Checkpoints with the user's models' real layer shapes and random weights, written
straight in their quantized formats (no full-precision copy is ever made), for
counting what a forward dispatches: Qwen3-Coder-30B-A3B in MLX affine 4-bit (as
`mlx_lm.convert -q` writes it, router at 8 bits) and GPT-OSS-120B in OpenAI's MXFP4
layout. Layers are cut to a few and the vocabulary to VOCAB (the counts per layer
do not depend on either); every other dimension is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 4096
GROUP = 64  # mlx_lm.convert's default group size


def qwen3_coder_config(layers: int, vocab: int = VOCAB) -> dict[str, Any]:
    """Qwen3-Coder-30B-A3B-Instruct's config.json, `layers` and `vocab` cut."""
    q: dict[str, Any] = {"group_size": GROUP, "bits": 4, "mode": "affine"}
    for i in range(layers):
        q[f"model.layers.{i}.mlp.gate"] = {"group_size": GROUP, "bits": 8}
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": vocab,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "quantization": q,
        "quantization_config": q,
    }


# gpt-oss' RoPE as its released config.json has it (YaRN, untruncated); the
# tiny test models (tests/tinymodels.py) use it too.
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss_120b_config(layers: int, vocab: int = VOCAB) -> dict[str, Any]:
    """gpt-oss-120b's config.json, `layers` and `vocab` cut."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
        + ["sliding_attention"] * (layers % 2),
        "attention_bias": True,
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": dict(GPT_OSS_ROPE),
        "rope_theta": 150000.0,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    }


# Both models cut to a few seconds on a CPU (the --cpu-smoke runs): every dimension
# small, the layout, formats and layer kinds as the real ones.
TINY: dict[str, dict[str, Any]] = {
    "qwen3-coder-30b-a3b": {
        "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "moe_intermediate_size": 64, "intermediate_size": 128, "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gpt-oss-120b": {
        "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 8,
    },
}  # fmt: skip


def _affine(out: dict[str, Any], name: str, shape: tuple[int, ...], bits: int = 4) -> None:
    """An MLX affine weight [..., rows, cols]: uint32 words, bf16 scales and biases."""
    import torch

    *lead, cols = shape
    words = torch.randint(0, 2**31 - 1, (*lead, cols * bits // 32), dtype=torch.int32)
    out[f"{name}.weight"] = words.view(torch.uint32)
    scales = torch.full((*lead, cols // GROUP), 0.01, dtype=torch.bfloat16)
    out[f"{name}.scales"] = scales
    out[f"{name}.biases"] = scales * -(2 ** (bits - 1))


def _bf16(*shape: int, std: float = 0.02) -> Any:
    import torch

    return (torch.randn(*shape) * std).to(torch.bfloat16)


def write_qwen3_coder(dst: Path, layers: int, vocab: int = VOCAB, tiny: bool = False) -> None:
    from safetensors.torch import save_file

    cfg = {**qwen3_coder_config(layers, vocab), **(TINY["qwen3-coder-30b-a3b"] if tiny else {})}
    h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    t: dict[str, Any] = {}
    _affine(t, "model.embed_tokens", (vocab, h))
    _affine(t, "lm_head", (vocab, h))
    t["model.norm.weight"] = _bf16(h, std=0) + 1
    for n in range(layers):
        p = f"model.layers.{n}"
        for proj, shape in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q))):
            _affine(t, f"{p}.self_attn.{proj}_proj", shape)
        t[f"{p}.self_attn.q_norm.weight"] = _bf16(hd, std=0) + 1
        t[f"{p}.self_attn.k_norm.weight"] = _bf16(hd, std=0) + 1
        _affine(t, f"{p}.mlp.gate", (e, h), bits=8)
        _affine(t, f"{p}.mlp.switch_mlp.gate_proj", (e, i, h))
        _affine(t, f"{p}.mlp.switch_mlp.up_proj", (e, i, h))
        _affine(t, f"{p}.mlp.switch_mlp.down_proj", (e, h, i))
        t[f"{p}.input_layernorm.weight"] = _bf16(h, std=0) + 1
        t[f"{p}.post_attention_layernorm.weight"] = _bf16(h, std=0) + 1
    _save(dst, cfg, t, save_file)


def write_gpt_oss_120b(dst: Path, layers: int, vocab: int = VOCAB, tiny: bool = False) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = {**gpt_oss_120b_config(layers, vocab), **(TINY["gpt-oss-120b"] if tiny else {})}
    h, e, i = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q, kvd = heads * cfg["head_dim"], kv * cfg["head_dim"]
    t: dict[str, Any] = {
        "model.embed_tokens.weight": _bf16(vocab, h),
        "lm_head.weight": _bf16(vocab, h),
    }
    t["model.norm.weight"] = _bf16(h, std=0) + 1
    for n in range(layers):
        p = f"model.layers.{n}"
        for proj, (rows, cols) in (("q", (q, h)), ("k", (kvd, h)), ("v", (kvd, h)), ("o", (h, q))):
            t[f"{p}.self_attn.{proj}_proj.weight"] = _bf16(rows, cols)
            t[f"{p}.self_attn.{proj}_proj.bias"] = _bf16(rows)
        t[f"{p}.self_attn.sinks"] = _bf16(heads)
        t[f"{p}.mlp.router.weight"] = _bf16(e, h)
        t[f"{p}.mlp.router.bias"] = _bf16(e)
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            x = f"{p}.mlp.experts.{name}"
            t[f"{x}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8)
            t[f"{x}_scales"] = torch.randint(118, 122, (e, rows, cols // 32), dtype=torch.uint8)
            t[f"{x}_bias"] = _bf16(e, rows)
        t[f"{p}.input_layernorm.weight"] = _bf16(h, std=0) + 1
        t[f"{p}.post_attention_layernorm.weight"] = _bf16(h, std=0) + 1
    _save(dst, cfg, t, save_file)


def _save(dst: Path, cfg: dict[str, Any], tensors: dict[str, Any], save_file: Any) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


WRITERS = {"qwen3-coder-30b-a3b": write_qwen3_coder, "gpt-oss-120b": write_gpt_oss_120b}


def synthetic_dir(model: str, layers: int, vocab: int = VOCAB) -> Path:
    """The cached checkpoint of `model` (a WRITERS key) with `layers` layers."""
    from disagg.bench.quantize import publish
    from disagg.serving.defaultmodel import cache_root

    out = cache_root() / "plan-checkpoints" / f"{model}-l{layers}-v{vocab}"
    return publish(lambda d: WRITERS[model](d, layers, vocab), out)

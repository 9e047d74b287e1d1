"""Tiny seeded random checkpoints, saved by transformers exactly as a real one would be.

`make_tiny(arch, out_dir)` writes a self-contained Hugging Face model dir (config,
safetensors weights, a small byte-level BPE tokenizer trained here) for one of the
architectures the adapters cover. The weights are random but seeded, with a larger
init std than transformers' default so that logits are peaked and greedy decoding
is decided by the function, not by float noise. Nothing is tuned to hide a
difference: each framework must compute the same function from these files.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from disagg.bench.synthmodels import GPT_OSS_ROPE

ARCHS = ("llama", "qwen3", "qwen3_moe", "gpt_oss")

SPECIALS = ["<|endoftext|>", "<|pad|>"]

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Disaggregated inference runs prefill on one machine and decode on another.",
    "The key value cache of every layer streams over a raw TCP socket.",
    "A mixture of experts routes each token to a few of its experts.",
    "Sliding window attention keeps only the most recent tokens of the prompt.",
    "Rotary position embeddings rotate queries and keys by their position.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time there was a tiny model with random weights.",
    "1234567890 + - * / = ( ) [ ] { } < > , . ; : ! ?",
]

# Prompts long enough for the tests: >= 4x gpt_oss' sliding window of 8.
PROMPT = (
    "Once upon a time the key value cache of a tiny model streamed over a raw TCP socket "
    "from one machine to another, and the sliding window kept only the most recent tokens."
)


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1]
    )


def _config(arch: str, vocab: int, eos: int, pad: int) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.25,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        dtype="float32",
    )
    if arch == "llama":
        return tf.LlamaConfig(
            **common,
            intermediate_size=128,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        )
    if arch == "qwen3":
        return tf.Qwen3Config(
            **common,
            intermediate_size=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[2],  # one dense layer: both MLP kinds get exercised
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            **common,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            attention_bias=True,
            rope_parameters=dict(GPT_OSS_ROPE),  # as the real gpt-oss config has it
        )
    raise ValueError(f"unknown tiny architecture {arch!r} (known: {', '.join(ARCHS)})")


def make_tiny(
    arch: str,
    out_dir: Path,
    seed: int = 0,
    chat: str | None = None,
    pooling: str | None = None,
    **overrides: Any,
) -> Path:
    """Build, seed and save a tiny `arch` checkpoint plus tokenizer into `out_dir`.

    `chat` gives it a tokenizer speaking a real chat format (tests/chattokenizers:
    "harmony", "qwen3", "qwen3_coder"). `pooling` ("lasttoken", "mean_tokens", ...)
    declares sentence-transformers pooling, as an embedding model ships it.
    `overrides` set config fields, e.g. rope_parameters={...YaRN...} on qwen3_moe.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if chat is not None:
        from tests.chattokenizers import build

        tok = build(chat)
        eos, pad = tok.eos_token_id, tok.pad_token_id
    else:
        tok = _tokenizer(vocab_size=512)
        eos, pad = tok.convert_tokens_to_ids(SPECIALS)
    vocab = len(tok)
    config = _config(arch, vocab, eos, pad)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights stay at 1, like a freshly initialised real model; gpt_oss'
            # zero-initialised biases get some value so the adapters must carry them.
            if name.endswith("norm.weight"):
                continue
            if p.dim() == 1 and not p.abs().any():
                p.normal_(0.0, 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if pooling is not None:
        declare_pooling(out_dir, **{f"pooling_mode_{pooling}": True})
    return out_dir


def declare_pooling(model_dir: Path, **modes: bool) -> None:
    """Write sentence-transformers' pooling files into `model_dir`."""
    (model_dir / "modules.json").write_text(
        json.dumps(
            [{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        )
    )
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(modes))


@cache
def _tiny_cache() -> Path:
    """$DISAGG_CACHE/test-checkpoints/tiny-<digest>: the digest covers the code that
    writes the checkpoints and the versions of the libraries that save them."""
    import tokenizers
    import torch
    import transformers

    from disagg.serving.defaultmodel import cache_root

    here = Path(__file__).parent
    h = hashlib.sha256(f"{transformers.__version__} {tokenizers.__version__}".encode())
    h.update(torch.__version__.encode())
    for f in (here / "tinymodels.py", here / "chattokenizers.py"):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return cache_root() / "test-checkpoints" / f"tiny-{h.hexdigest()[:16]}"


def tiny_checkpoint(arch: str, seed: int = 0, **config: Any) -> Path:
    """make_tiny(arch, seed=seed, **config), written once per machine and shared by
    every session (an agent set is keyed by this path)."""
    from disagg.bench.quantize import publish

    def part(value: Any) -> str:
        if isinstance(value, str | int | float | bool):
            return str(value)
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]

    name = f"{arch}-{seed}" + "".join(f"-{k}={part(config[k])}" for k in sorted(config))
    return publish(lambda d: make_tiny(arch, d, seed=seed, **config), _tiny_cache() / name)


# The tiny checkpoints tests share, and with them their pooled agent sets:
# name -> (architecture, seed, config). llama keeps a plain tokenizer (no chat
# template, no FIM tokens: the refusal tests want that); qwen3 and gpt_oss speak
# their real chat formats, so the format tests and the rest share one set each;
# qwen3_coder's context holds the agent CLIs' ~46k-token prompts; qwen3 declares
# last-token pooling as Qwen3-Embedding ships it (the embedding tests use its set).
SHARED: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama": ("llama", 3, {}),
    "qwen3": ("qwen3", 0, {"chat": "qwen3", "pooling": "lasttoken"}),
    "qwen3_moe": ("qwen3_moe", 1, {}),
    "gpt_oss": ("gpt_oss", 0, {"chat": "harmony"}),  # sliding window 8
    "qwen3_coder": ("qwen3", 0, {"chat": "qwen3_coder", "max_position_embeddings": 131072}),
}


def shared_tiny(name: str) -> Path:
    """The shared tiny checkpoint `name` (SHARED)."""
    arch, seed, config = SHARED[name]
    return tiny_checkpoint(arch, seed, **config)

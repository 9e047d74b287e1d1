"""Monolithic reference runs: transformers' generate and mlx-lm's own generation, and
the prompt ids the tokenizer itself makes (to check the ids the agents used)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import torch
from mlx_lm.generate import generate_step


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers generate, greedy, exactly n new tokens (EOS is just a token)."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = []  # None falls back to the model's EOS; [] means none
    cfg.pad_token_id = 0
    cfg.do_sample = False
    cfg.max_new_tokens = n
    cfg.temperature = cfg.top_p = cfg.top_k = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            generation_config=cfg,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return [int(t) for t in out[0, len(ids) :]]


def mlx_greedy(model: Any, ids: list[int], n: int, cache: list[Any] | None = None) -> list[int]:
    """mlx-lm's generate_step from a fresh cache, or continued from a given one."""
    steps = generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache)
    return [int(tok) for tok, _ in steps]


def tokenizer_ids(model_dir: str | Path, prompt: str, *, raw: bool = False) -> list[int]:
    """The prompt's ids from transformers' own tokenizer of the dir: the chat template
    with the generation prompt for one user message, or the plain encoding when raw."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if raw or not tok.chat_template:
        return [int(i) for i in tok.encode(prompt)]
    messages = [{"role": "user", "content": prompt}]
    out: Any = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return [int(i) for i in out["input_ids"]]

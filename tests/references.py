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


class References:
    """Reference models loaded once per test session and shared (read-only: a
    generation keeps its state in its own cache): transformers' model, mlx-lm's own
    `load`, and our engines where a test takes them as its reference."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[Any, ...], Any] = {}

    def _get(self, key: tuple[Any, ...], load: Any) -> Any:
        if key not in self._loaded:
            self._loaded[key] = load()
        return self._loaded[key]

    def hf(self, path: str | Path) -> Any:
        """transformers' AutoModelForCausalLM in float32, eval mode."""
        from transformers import AutoModelForCausalLM

        return self._get(
            ("hf", str(path)),
            lambda: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(),
        )

    def mlx_load(self, path: str | Path) -> tuple[Any, Any]:
        """mlx-lm's own `load` (no adapter of ours): the model and its tokenizer."""
        from mlx_lm import load

        return self._get(("mlx", str(path)), lambda: tuple(load(str(path))[:2]))

    def mlx(self, path: str | Path) -> Any:
        """mlx-lm's own `load`: the model."""
        return self.mlx_load(path)[0]

    def decode_engine(self, path: str | Path, dtype: str = "auto") -> Any:
        """Our DecodeEngine (mlx-lm with our adapter's config)."""
        from disagg_agents.decode.agent import DecodeEngine

        return self._get(("decode", str(path), dtype), lambda: DecodeEngine(str(path), dtype=dtype))

    def prefill_engine(self, path: str | Path, dtype: str = "auto") -> Any:
        """Our PrefillEngine on the CPU."""
        from disagg_agents.prefill.agent import PrefillEngine

        return self._get(
            ("prefill", str(path), dtype),
            lambda: PrefillEngine(str(path), device="cpu", dtype=dtype),
        )

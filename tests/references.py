"""Monolithic reference runs: transformers' generate and mlx-lm's own generation, and
the prompt ids the tokenizer itself makes (to check the ids the agents used)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import torch
from mlx_lm.generate import generate_step

# A near-tie: two logits closer than this (fp32 logits of magnitude ~10; float sums in
# another order move them by ~1e-5).
TIE = 1e-3


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


def near_tie_misses(
    model: Any, prompt_ids: list[int], got: list[int], tol: float = TIE
) -> list[tuple[int, float]]:
    """Each token of `got` checked against the reference model, teacher-forced on the
    prompt and `got` itself (one forward pass): where it is not the reference's argmax,
    (position, how far its logit is below the top). A batched run may differ from a
    run alone only where float sums in another order flip a near-tie: every gap then
    stays under `tol`. A larger gap is a real difference, not that cause."""
    logits = model(mx.array([prompt_ids + got[:-1]]))[0, len(prompt_ids) - 1 :]
    logits = logits.astype(mx.float32)
    top = mx.max(logits, axis=-1)
    mine = mx.take_along_axis(logits, mx.array(got)[:, None], axis=-1)[:, 0]
    gaps: Any = (top - mine).tolist()  # [tokens] floats
    return [(k, float(g)) for k, g in enumerate(gaps) if g > 0]


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

    def mlx_own(self, path: str | Path) -> Any:
        """mlx-lm's own `load` and model code on any dir transformers saved: the
        config keys and expert layout it reads (`mlx_lm_dir`), transformers' own YaRN
        frequencies where the config asks for YaRN (`use_transformers_yarn`); none of
        our adapter. Token-identical to transformers on every tiny architecture."""

        def load() -> Any:
            import atexit
            import json
            import shutil
            import tempfile

            from mlx_lm import load as mlx_lm_load

            tmp = Path(tempfile.mkdtemp(prefix="mlx-own-"))
            atexit.register(shutil.rmtree, tmp, True)
            model = mlx_lm_load(str(mlx_lm_dir(path, tmp / "model")))[0]
            cfg = json.loads((Path(path) / "config.json").read_text())
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if rope.get("rope_type", rope.get("type")) == "yarn":
                assert use_transformers_yarn(model, path) > 0
            return model

        return self._get(("mlx-own", str(path)), load)

    def decode_engine(self, path: str | Path, dtype: str = "auto") -> Any:
        """Our DecodeEngine (mlx-lm with our adapter's config)."""
        from disagg_agents.decode.engine import DecodeEngine

        return self._get(("decode", str(path), dtype), lambda: DecodeEngine(str(path), dtype=dtype))

    def prefill_engine(self, path: str | Path, dtype: str = "auto") -> Any:
        """Our PrefillEngine on the CPU."""
        from disagg_agents.prefill.agent import PrefillEngine

        return self._get(
            ("prefill", str(path), dtype),
            lambda: PrefillEngine(str(path), device="cpu", dtype=dtype),
        )


def mlx_lm_dir(model_dir: str | Path, out: Path) -> Path:
    """A copy of a transformers-saved dir that mlx-lm's own `load` reads as transformers
    does, each change a named cause (docs/testing.md, "references"):
    - config: transformers 5 writes `rope_parameters` and `num_local_experts`; mlx-lm
      reads `rope_theta` (and `rope_scaling`) and `num_experts`;
    - gpt_oss experts: transformers keeps `gate_up_proj` as [E, hidden, 2I] and
      `down_proj` as [E, I, hidden]; mlx-lm's own `sanitize` takes OpenAI's
      [E, 2I, hidden] / [E, hidden, I] under `.weight` names and splits them itself.
    Everything else (weights, tokenizer) is linked, not copied."""
    import json

    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = {**rope, "type": rope["rope_type"]}  # the key mlx-lm reads
    if "num_local_experts" in cfg and "num_experts" not in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name == "config.json" or (out / f.name).exists():
            continue
        if f.suffix == ".safetensors" and cfg.get("model_type") == "gpt_oss":
            w = load_file(str(f))
            for k in [k for k in w if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
                w[f"{k}.weight"] = np.ascontiguousarray(np.swapaxes(w.pop(k), -1, -2))
            save_file(w, str(out / f.name))
        else:
            (out / f.name).symlink_to(f.resolve())
    return out


def use_transformers_yarn(model: Any, model_dir: str | Path) -> int:
    """Give each RoPE of an mlx-lm model transformers' own YaRN frequencies and
    attention factor (its ROPE_INIT_FUNCTIONS, from the dir's config): mlx-lm's
    YarnRoPE floors/ceils the correction range (gpt-oss says `truncate: false`) and
    drops the attention factor, a named cause of drift that grows with position.
    Returns how many RoPE modules it set."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(str(model_dir))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    freqs = mx.array((1.0 / inv_freq.double()).float().numpy())
    n = 0
    for _, mod in model.named_modules():
        rope = getattr(mod, "rope", None)
        if rope is not None and hasattr(rope, "_freqs"):
            rope._freqs, rope.mscale = freqs, float(factor)
            n += 1
    return n


def hf_embedding(model_dir: str | Path, text: str, pooling: str) -> tuple[list[float], int]:
    """A plain transformers forward (AutoModel, float32, the tokenizer's own special
    tokens) pooled as the checkpoint declares ("last", "mean" or "cls") and
    L2-normalized; with the number of tokens it read."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [int(i) for i in tok(text)["input_ids"]]
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]  # [tokens, hidden]
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    return (v / v.norm()).tolist(), len(ids)

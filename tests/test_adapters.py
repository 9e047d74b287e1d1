"""One checkpoint, one function: transformers, mlx-lm and the disaggregated path
(torch prefill -> KV wire -> mlx decode) must agree token for token.

Tiny seeded random checkpoints are built once per session (tests/tinymodels.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tinymodels import PROMPT

pytestmark = pytest.mark.slow

NEW_TOKENS = 32  # four sliding windows (8) past any prompt; every step compared
ARCHS = ["qwen3_moe", "gpt_oss", "llama", "qwen3"]
# YaRN, untruncated, where mlx-lm gets it wrong: qwen3_moe builds a plain RoPE,
# llama truncates the correction range.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 1024,
    "truncate": False,
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{arch: (arch, {}) for arch in ARCHS},
    "qwen3_moe+yarn": ("qwen3_moe", {"rope_parameters": YARN}),
    "llama+yarn": ("llama", {"rope_parameters": YARN}),
    # mlx-lm's gpt_oss always has attention biases and an lm_head.
    "gpt_oss-bias+tied": ("gpt_oss", {"attention_bias": False, "tie_word_embeddings": True}),
}
# Logprobs of two frameworks on one fp32 checkpoint: float noise only.
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="session")
def tiny_dirs(tiny_model: Callable[..., Path]) -> dict[str, Path]:
    return {
        name: tiny_model(arch, seed=0, **overrides) for name, (arch, overrides) in VARIANTS.items()
    }


@pytest.fixture(scope="session")
def loaded() -> dict[str, tuple[Any, Any]]:
    return {}


@pytest.fixture
def engines(
    tiny_dirs: dict[str, Path], loaded: dict[str, tuple[Any, Any]], request: pytest.FixtureRequest
) -> tuple[Any, Any]:
    """(PrefillEngine, DecodeEngine) on the tiny checkpoint of the test's `arch`,
    each loaded once per session."""
    from disagg_agents.decode.engine import DecodeEngine
    from disagg_agents.prefill.engine import PrefillEngine

    arch = request.node.callspec.params["arch"]
    if arch not in loaded:
        d = str(tiny_dirs[arch])
        loaded[arch] = (PrefillEngine(d, device="cpu"), DecodeEngine(d))
    return loaded[arch]


def prompt(engine: Any, length: int | None = None) -> list[int]:
    ids = list(engine.tokenizer.encode(PROMPT))
    while length is not None and len(ids) < length:
        ids += ids
    return ids[:length] if length is not None else ids


def hf_greedy(pre: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' own generate, greedy, EOS ignored (never suppressed)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=None,
        pad_token_id=pre.cfg.get("pad_token_id") or 0,
    )
    with torch.inference_mode():
        out = pre.model.generate(
            torch.tensor([ids]),
            generation_config=gen,
            return_dict_in_generate=True,
            output_scores=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1).numpy()
    return tokens, logprobs


def mlx_greedy(model: Any, first: Any, cache: list[Any], n: int) -> tuple[list[int], np.ndarray]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for tok, lp in generate_step(first, model, prompt_cache=cache, max_tokens=n):
        tokens.append(int(tok))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return tokens, np.stack(logprobs)


def mlx_local(dec: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    return mlx_greedy(dec.model, mx.array(ids), make_prompt_cache(dec.model), n)


def disaggregated(pre: Any, dec: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Torch prefills ids; each layer crosses the wire codec into mlx caches; mlx
    decodes on from the first token sampled from torch's last-position logits, on
    the decode agent's own batching loop."""
    from mlx_lm.models.cache import make_prompt_cache

    from disagg_agents.decode.firsttoken import first_token
    from disagg_agents.decode.kvcaches import fill_layer
    from disagg_agents.decode.loop import DecodeLoop, Seq
    from disagg_agents.wire.kvcodec import Codec, LayerKV, decode_layer, encode_layer

    layers: list[LayerKV] = []
    _, logits = pre.prefill(ids, layers.append)
    assert [kv.layer for kv in layers] == list(range(len(pre.layers)))
    cache = make_prompt_cache(dec.model)
    for i, kv in enumerate(layers):
        codec = Codec.SHUFFLE_ZSTD if i % 2 else Codec.RAW
        wire = b"".join(bytes(b) for b in encode_layer(kv, codec))
        fill_layer(cache[kv.layer], decode_layer(wire), len(ids))
    loop = DecodeLoop(dec.model)
    tok, lp = loop.call(first_token, logits, None, True)
    seq = Seq(cache, tok, None, n, frozenset(), want_logprobs=True)
    loop.join(seq)
    tokens, logprobs = [tok], [lp]
    while (item := seq.out.get()) is not None:
        assert not isinstance(item, Exception), item
        tokens.append(item[0])
        logprobs.append(item[1])
    return tokens, np.stack(logprobs)


def assert_same(
    name: str, want: tuple[list[int], np.ndarray], got: tuple[list[int], np.ndarray]
) -> None:
    (wt, wl), (gt, gl) = want, got
    assert len(wt) == len(gt) == NEW_TOKENS
    first = next((i for i, (a, b) in enumerate(zip(wt, gt, strict=True)) if a != b), None)
    assert first is None, f"{name}: token {first} differs: {wt[first]} vs {gt[first]}\n{wt}\n{gt}"
    err = float(np.abs(wl - gl).max())
    print(f"{name}: max logprob diff {err:.2e}, {len(set(wt))} distinct tokens")
    assert err < LOGPROB_ATOL, f"{name}: logprobs differ by up to {err}"


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_fingerprints_match(arch: str, engines: tuple[Any, Any]) -> None:
    from disagg_agents.wire.fingerprint import fingerprint_mismatch

    pre, dec = engines
    assert fingerprint_mismatch(pre.fingerprint, dec.fingerprint) == []
    if arch == "gpt_oss":
        assert pre.fingerprint["layers"] == [["sliding", 8], ["full", 0]] * 2


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_greedy_torch_mlx_disaggregated_agree(arch: str, engines: tuple[Any, Any]) -> None:
    pre, dec = engines
    ids = prompt(dec)
    if arch == "gpt_oss":
        assert len(ids) >= 4 * int(pre.cfg["sliding_window"])
    hf = hf_greedy(pre, ids, NEW_TOKENS)
    assert_same("mlx-lm vs transformers", hf, mlx_local(dec, ids, NEW_TOKENS))
    assert_same("disaggregated vs transformers", hf, disaggregated(pre, dec, ids, NEW_TOKENS))


@pytest.mark.parametrize("length", [2, 7, 8, 9, 10, 17, 150])
@pytest.mark.parametrize("arch", ["gpt_oss"])
def test_sliding_window_prompt_lengths(arch: str, length: int, engines: tuple[Any, Any]) -> None:
    """Prompts shorter than, around and far beyond the window of 8 fill the
    RotatingKVCache in every state mlx can be in."""
    pre, dec = engines
    ids = prompt(dec, length)
    assert len(ids) == length
    assert_same(
        "disaggregated vs mlx-lm",
        mlx_local(dec, ids, NEW_TOKENS),
        disaggregated(pre, dec, ids, NEW_TOKENS),
    )


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe+yarn", "llama+yarn"])
def test_yarn_is_transformers_yarn(arch: str, engines: tuple[Any, Any]) -> None:
    """mlx RoPE uses transformers' YaRN frequencies (truncate: false), not mlx-lm's."""
    import mlx.core as mx

    pre, dec = engines
    want = pre.model.model.rotary_emb.inv_freq.numpy()
    scale = pre.model.model.rotary_emb.attention_scaling
    for layer in dec.model.layers:
        rope = layer.self_attn.rope
        np.testing.assert_allclose(1.0 / np.array(rope._freqs.astype(mx.float32)), want, rtol=1e-6)
        assert rope.mscale == pytest.approx(scale, rel=1e-6)

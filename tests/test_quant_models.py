"""Quantized checkpoints end to end: the prefill agent's packed weights against
mlx's own dequantization, real agent pairs against mlx-lm's own `load` on the same dir
(transformers where our adapter changes what mlx-lm computes),
mixed weights refused (or allowed and labelled), and packed prefill's memory.

Dirs are written once per machine (tests/quantmodels.py): SmolLM2 by
mlx_lm.convert at affine 4/8-bit and mxfp4, a tiny qwen3_moe at affine 4-bit
(8-bit router), a tiny gpt_oss in OpenAI's MXFP4 layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ModelMismatch
from disagg.serving.localagents import AgentProc
from tests.conftest import PairFactory, ask, remote_request
from tests.quantmodels import DIRS, quant_dir
from tests.tinymodels import PROMPT

from .references import hf_greedy, mlx_greedy, tokenizer_ids

pytestmark = pytest.mark.slow

N_NEW = 64
# SmolLM2's dirs run an eighth as long: ~70 ms a token on this CPU, twice (agents and
# reference), and a quantized dir's own rounding shows in its first tokens; the tiny
# MoE dirs, cheap to decode, keep all 64.
N_NEW_OF = {"smol-affine4": 8, "smol-affine8": 8, "smol-mxfp4": 8}
# The prompt: PROMPT twice on the tiny dirs (cheap); once on SmolLM2's (36 tokens, not
# 72; SmolLM2 has no sliding window to outrun): mlx-lm's quantized matmuls on a Linux
# CPU cost ~0.1 s a prompt token, and the reference, mlx-lm alone, prefills the prompt
# itself (the agents' prefill runs on torch).
SMOL = {"smol-affine4", "smol-affine8", "smol-mxfp4"}


def prompt_of(name: str) -> str:
    return PROMPT if name in SMOL else " ".join([PROMPT] * 2)


@pytest.fixture(scope="module")
def pair_for(agent_pair: PairFactory) -> Callable[[str], tuple[AgentProc, AgentProc]]:
    """The agent pair serving a quantized dir, started on first use."""
    started: dict[str, tuple[AgentProc, AgentProc]] = {}

    def get(name: str) -> tuple[AgentProc, AgentProc]:
        if name not in started:
            started[name] = agent_pair(quant_dir(name))
        return started[name]

    return get


def request(prefill: AgentProc, prompt: str, n: int = N_NEW) -> dict[str, Any]:
    return remote_request(prefill, prompt, n, return_prompt_ids=True)


def mlx_counterpart(torch_model: Any, path: str) -> Any:
    """The Packed weight the prefill model holds for mlx-lm's module `path`."""
    from disagg_agents.quant.modules import PackedExperts

    for store in ("switch_mlp", "experts"):
        for proj in ("gate", "up", "down"):
            suffix = f".mlp.{store}.{proj}_proj"
            if path.endswith(suffix):
                experts = torch_model.get_submodule(path[: -len(suffix)] + ".mlp.experts")
                assert isinstance(experts, PackedExperts)
                return getattr(experts, proj)
    return torch_model.get_submodule(path).__dict__["packed"]


@pytest.mark.parametrize("name", DIRS)
def test_packed_weights_are_bit_identical_to_mx_dequantize(name: str) -> None:
    """Every quantized module mlx-lm builds from the dir, dequantized by mlx, equals
    what the prefill agent dequantizes from its packed copy."""
    import mlx.core as mx
    import torch
    from mlx_lm.utils import load_model

    from disagg_agents.prefill.engine import PrefillEngine
    from disagg_agents.quant.dequant import Packed

    from .test_quant_units import same_bits, to_torch

    d = quant_dir(name)
    pre = PrefillEngine(str(d), device="cpu")
    model, _ = load_model(d)
    checked = modes = 0
    seen_modes = set()
    for path, mod in model.named_modules():
        if "scales" not in mod:
            continue
        ref = mx.dequantize(
            mod["weight"],
            mod["scales"],
            mod.get("biases"),
            mod.group_size,
            mod.bits,
            mode=mod.mode,
            dtype=mx.float32 if mod.mode != "affine" else None,
        )
        ours = mlx_counterpart(pre.model, path)
        assert isinstance(ours, Packed), path
        assert (ours.spec.mode, ours.spec.bits, ours.spec.group_size) == (
            mod.mode,
            mod.bits,
            mod.group_size,
        ), path
        assert same_bits(ours.full(), to_torch(ref).to(ours.dtype)), path
        checked += 1
        seen_modes.add((mod.mode, mod.bits))
    modes = len(seen_modes)
    assert checked > 0 and modes >= 1
    if name == "moe-affine4":  # mlx-lm's 8-bit router override, and 4-bit experts
        assert seen_modes == {("affine", 4), ("affine", 8)}
    assert pre.packed_bytes > 0 and all(p.device.type != "meta" for p in pre.model.parameters())
    del torch


# Dirs on which our decode adapter changes what mlx-lm would compute (gpt_oss' YaRN RoPE is
# replaced by transformers' own): there the reference is transformers, dequantizing the
# MXFP4 experts itself. Elsewhere it is mlx-lm's own `load`, with no adapter of ours.
TRANSFORMED = {"gptoss-hf-mxfp4"}


def reference_greedy(name: str, ids: list[int], refs: Any) -> list[int]:
    """The dir's greedy tokens from a monolithic run that shares no code with the agents."""
    d, n = quant_dir(name), N_NEW_OF.get(name, N_NEW)
    if name in TRANSFORMED:
        import torch
        from transformers import AutoModelForCausalLM, Mxfp4Config  # type: ignore[attr-defined]

        model = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
        )
        # transformers 5.17 leaves the dequantized experts in bf16 whatever dtype says
        # (5.24 does not): the values are exact either way, the arithmetic is not.
        return hf_greedy(model.float().eval(), ids, n)
    return mlx_greedy(refs.mlx(d), ids, n)


@pytest.mark.parametrize("name", DIRS)
def test_the_reference_is_chosen_by_what_our_adapter_changes(name: str) -> None:
    """Stock mlx-lm is a fair reference only where the adapter leaves config and RoPE alone."""
    from disagg_agents.models import get_adapter
    from disagg_agents.models.base import hf_rope_parameters, load_hf_config

    cfg = load_hf_config(quant_dir(name))
    untouched = (
        get_adapter(cfg["model_type"]).mlx_config(cfg) == {}
        and hf_rope_parameters(cfg)["rope_type"] == "default"
    )
    assert untouched == (name not in TRANSFORMED), cfg


@pytest.mark.parametrize("name", DIRS)
def test_agents_on_one_quantized_dir_match_an_independent_reference(
    pair_for: Callable[[str], tuple[AgentProc, AgentProc]], refs: Any, name: str
) -> None:
    prefill, decode = pair_for(name)
    n = N_NEW_OF.get(name, N_NEW)
    res = ask(decode, request(prefill, prompt_of(name), n))
    assert res.metrics.method == "disaggregated" and res.metrics.weights == "same"
    ids = tokenizer_ids(quant_dir(name), prompt_of(name), raw=True)
    assert res.prompt_ids == ids
    alone = reference_greedy(name, ids, refs)
    assert len(alone) == n and res.token_ids == alone


def test_mixed_weights_are_refused_unless_allowed_then_labelled(
    pair_for: Callable[[str], tuple[AgentProc, AgentProc]],
    smol_agents: tuple[AgentProc, AgentProc],
    agent_pair: PairFactory,
    default_model: Path,
) -> None:
    """A decode agent on SmolLM2's full-precision dir asked to take K/V from a prefill
    agent on its 4-bit conversion: one line naming both. A decode agent started with
    --allow-mixed (on the 4-bit dir, asking the full-precision prefill) runs, labelled."""
    q4_prefill, _ = pair_for("smol-affine4")
    full_prefill, full_decode = smol_agents
    with pytest.raises(ModelMismatch) as info:
        ask(full_decode, request(q4_prefill, PROMPT, 4))
    line = str(info.value)
    assert str(default_model) in line and str(quant_dir("smol-affine4")) in line
    assert "4-bit affine g64" in line and "full precision" in line
    assert "--allow-mixed" in line and "mixed_weights = true" in line
    _, allowed = agent_pair(quant_dir("smol-affine4"), decode_args=["--allow-mixed"])
    res = ask(allowed, request(full_prefill, PROMPT, 4))
    assert res.metrics.method == "disaggregated" and res.metrics.weights == "mixed"


def test_packed_prefill_memory_stays_within_checkpoint_bytes() -> None:
    """Fresh process: RSS growth over an idle agent, through load and prefill, stays
    within 1.25x the checkpoint + one layer dequantized (+ the prompt's K/V, which
    prefill holds until sent); dequantizing at load would not."""
    from disagg.bench import quant_weights as bench

    d = quant_dir("smol-affine4")
    packed = bench.probe(d, "packed", tokens=128, repeats=1)
    budget = 1.25 * packed["checkpoint_bytes"] + packed["one_layer_dequantized_bytes"]
    assert packed["loaded_rss_growth"] <= 1.1 * packed["checkpoint_bytes"]
    assert packed["peak_rss_growth"] - packed["kv_cache_bytes"] <= budget

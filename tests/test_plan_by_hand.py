"""`disagg plan`'s figures worked by hand from the model cards' shapes and the
hardware figures plan prints: a wrong layer count, head size, expert width or
efficiency in the cost model moves one of these sums."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg_agents.models.moecost import expected_blocks


@pytest.fixture(scope="module")
def plan() -> dict[str, Any]:
    from typer.testing import CliRunner

    from disagg.cli import app

    done = CliRunner().invoke(app, ["plan", "--json"])
    assert done.exit_code == 0, done.output
    return dict(json.loads(done.stdout))


def prompt(plan: dict[str, Any], model: str, tokens: int) -> dict[str, Any]:
    return next(p for p in plan["models"][model]["prompts"] if p["tokens"] == tokens)


def test_kv_bytes_from_the_model_cards(plan: dict[str, Any]) -> None:
    # Qwen3-Coder-30B-A3B: 48 layers, 4 K/V heads of 128, bf16; K and V.
    assert prompt(plan, "qwen3-coder-30b-a3b", 2048)["kv_bytes"] == 48 * 2 * 4 * 128 * 2 * 2048
    # gpt-oss-120b: 36 layers alternating full and a 128-token window, 8 K/V heads of 64.
    full = 18 * 2 * 8 * 64 * 2 * 8192
    window = 18 * 2 * 8 * 64 * 2 * 128
    assert prompt(plan, "gpt-oss-120b", 8192)["kv_bytes"] == full + window == 306_708_480


def test_spark_prefill_of_qwen3_coder_at_2k(plan: dict[str, Any]) -> None:
    p = prompt(plan, "qwen3-coder-30b-a3b", 2048)
    terms, eff, peak = p["spark_terms"], plan["efficiency"]["gb10"], plan["spark"]["flops"]
    # Per layer, hidden 2048: q and o 2048x4096 each, k and v 2048x512 each; a router
    # 2048x128: cuBLAS, at the Spark's dense efficiency. 2 FLOPs a MAC over 48 layers
    # and 2,048 tokens, plus the LM head (vocab 151,936) on the last position.
    dense = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2048 * 128
    flops = 2 * 48 * dense * 2048 + 2 * 2048 * 151_936
    assert terms["matmul_s"] == pytest.approx(flops / (peak * eff["dense"]), rel=1e-9)
    # The 8 routed experts (gate, up and down, 2048x768 each) on the fused kernel, at
    # the GB10's tiles: 64-row blocks; 16,384 pairs over 128 experts, 128 an expert on
    # average: 2 or 3 blocks each, every row of a block computed, at the kernel's
    # share of peak (taken from sm90 until a GB10 runs it). Compute-bound: the blocks'
    # packed weights (4.5 bits) take less at 273 GB/s.
    blocks = expected_blocks(2048, 8, 128, 64)
    assert 128 * 2.4 < blocks < 128 * 2.6
    expert = 3 * 2048 * 768
    padded = 2 * blocks * 64 * expert
    assert blocks * expert * 4.5 / 8 / plan["spark"]["bandwidth"] < padded / (peak * 0.160)
    assert terms["moe_s"] == pytest.approx(48 * padded / (peak * 0.160), rel=1e-9)
    # Attention: 2048 x 2049 / 2 causal scores x 32 heads x 48 layers at score_ps each.
    scores = 2048 * 2049 // 2 * 32 * 48
    assert terms["attention_s"] == pytest.approx(scores * eff["score_ps"] * 1e-12, rel=1e-9)
    # The rest is compute-bound too (the weights' read takes less): the three add up.
    assert terms["memory_s"] < terms["matmul_s"] + terms["attention_s"]
    total = terms["matmul_s"] + terms["attention_s"] + terms["moe_s"]
    assert p["spark_prefill_s"] == pytest.approx(total)


def test_weights_and_speedup_hold_together(plan: dict[str, Any]) -> None:
    # 30.5B parameters at 4.5 bits (4-bit with a bf16 scale and bias per 64) ~ 17.2 GB.
    gb = plan["models"]["qwen3-coder-30b-a3b"]["weights_gb"]
    assert gb == pytest.approx(30.5e9 * 4.5 / 8 / 1e9, rel=0.02)
    for model in ("qwen3-coder-30b-a3b", "gpt-oss-120b"):
        for p in plan["models"][model]["prompts"]:
            assert p["speedup"] == pytest.approx(p["ttft_mac_alone_s"] / p["ttft_split_s"])
            # The split's TTFT is the Spark's prefill plus at least the last layer's K/V.
            assert p["ttft_split_s"] > p["spark_prefill_s"]

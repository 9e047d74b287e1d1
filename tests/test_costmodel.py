"""The cost model (disagg_agents.models.cost, disagg.bench.costmodel): counts against a
small case worked by hand, the placement's prior, and `disagg plan --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from disagg.bench.costmodel import Counts, scenario
from disagg_agents.decode.placement import Placement
from disagg_agents.models.cost import (
    DEVICES,
    Prior,
    Shape,
    attention_flops,
    experts_hit,
    kv_bytes,
    prefill_flops,
    prior,
    roofline_s,
    weight_bytes,
)

# One MoE layer: hidden 4, 2 query heads and 1 K/V head of 2, 4 experts of width 3,
# top-2, a vocabulary of 8; experts 4-bit, the rest bf16.
TINY = Shape(
    layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, vocab=8,
    experts=4, top_k=2, inter=3, expert_bits=4.0,
)  # fmt: skip


def test_flops_of_one_layer_by_hand() -> None:
    # Parameters: attention 4x(4+2+2) + 4x4 = 48; router 4x4 = 16; one expert 3x4x3 = 36.
    assert (TINY.attn_params, TINY.router_params, TINY.expert_params) == (48, 16, 36)
    # Per token: 2 x (48 + 16 + 2 experts x 36) = 272. Three tokens, causal: 1+2+3 = 6
    # positions attended, x 4 (two matmuls, 2 FLOPs a MAC) x 2 heads x 2 dims = 96.
    # The LM head on the last position: 2 x 4 x 8 = 64.
    assert attention_flops(TINY, 3) == 96
    assert prefill_flops(TINY, 3) == 272 * 3 + 96 + 64 == 976
    # After 2 cached positions the same 3 tokens attend to 3+4+5 = 12 positions.
    assert prefill_flops(TINY, 3, context=2) == 272 * 3 + 4 * 2 * 2 * 12 + 64


def test_bytes_of_one_layer_by_hand() -> None:
    # 3 tokens x top-2 over 4 experts hit 4 x (1 - (1/2)^3) = 3.5 experts on average.
    assert experts_hit(TINY, 3) == 3.5
    bf16 = 48 * 2 + 16 * 2 + 32 * 2  # attention, router, LM head [8, 4]
    packed = weight_bytes(TINY, 3, "packed")
    assert packed["weights_read"] == bf16 + 3.5 * 36 * 4 / 8  # 255
    assert packed["dequantized"] == 4 * 36 * 2  # every expert, to bf16: 288
    assert packed["read"] == 255 + 2 * 288  # written, then read by the GEMM
    kept = weight_bytes(TINY, 3, "kept")
    assert (kept["weights_read"], kept["dequantized"]) == (bf16 + 3.5 * 36 * 2, 0)
    fused = weight_bytes(TINY, 3, "fused")
    assert (fused["read"], fused["dequantized"]) == (255, 0)
    # K/V: keys and values of 1 head x 2 dims in bf16 = 8 bytes per token and layer.
    assert kv_bytes(TINY, 3) == 24
    # A sliding layer (window 2) beside a full one sends 2 positions, not 3.
    slid = Shape(**{**TINY.__dict__, "layers": 2, "sliding_window": 2, "sliding_layers": 1})
    assert kv_bytes(slid, 3) == 8 * (3 + 2)
    # ... and attends to min(position, 2): 1 + 2 + 2 = 5 positions.
    assert attention_flops(slid, 3) == 4 * 2 * 2 * (6 + 5)


def test_roofline_adds_launches_and_syncs() -> None:
    d = DEVICES["gb10"]
    assert roofline_s(d.flops, 0, d) == 1.0
    assert roofline_s(0, d.bandwidth * 2, d, ops=1000, syncs=10) == pytest.approx(
        2 + 1000 * d.launch_s + 10 * d.sync_s
    )


def test_syncs_and_launches_cost_the_spark_prefill() -> None:
    """The per-expert loop's launches and syncs (measured at commit 48f74c2) put
    seconds on a Qwen3-Coder prefill the grouped path does not pay."""
    from disagg.bench.costmodel import MODELS

    counts = Counts(104, 0, 34, 0, 63, 0, 2, "kept")
    sc = scenario(MODELS["qwen3-coder-30b-a3b"], 3300, 0, counts)
    assert sc["spark_prefill_loop_s"] - sc["spark_prefill_s"] > 1.0
    assert sc["ttft_disaggregated_s"] > sc["spark_prefill_s"]


def test_placement_uses_the_prior_until_it_has_measured() -> None:
    p = Placement(Prior(10_000, 5_000, 1_000, 1.25e9, 0.002))
    where, why = p.choose("a:1", 3)  # 0.6 ms here vs 2 ms of handshake there
    assert where == "local" and "from the prior" in why
    assert p.choose("a:1", 20_000)[0] == "remote"  # 4 s here vs ~2 s there
    assert Placement().choose("a:1", 3)[0] == "remote"  # no prior: as before


def test_prior_from_a_config_favours_the_spark_for_long_prompts() -> None:
    cfg = {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    }  # fmt: skip
    pr = prior(cfg, bits=4.5)
    assert pr.remote_tokens_per_s > pr.local_tokens_per_s > 0
    assert pr.layer_bytes_per_token == 2 * 4 * 128 * 2


@pytest.mark.slow
def test_plan_json_has_every_model_and_load() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "plan", "--json", "--count-layers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data = json.loads(done.stdout)
    assert "not a measurement" in data["note"]
    assert set(data["models"]) == {"qwen3-coder-30b-a3b", "gpt-oss-120b"}
    for m in data["models"].values():
        assert set(m["scenarios"]) == {
            "rubric + submission",
            "rubric cached, submission",
            "8k prompt",
        }
        assert m["forward_2048"]["flops"] > 0 and m["forward_2048"]["aten_ops"] is None
        for sc in m["scenarios"].values():  # the figures hang together
            assert sc["speedup_ttft"] == pytest.approx(
                sc["ttft_mac_alone_s"] / sc["ttft_disaggregated_s"]
            )
            assert sc["ttft_disaggregated_s"] > sc["spark_prefill_s"]  # plus the link
    assert all(d["source"] for d in data["devices"].values())
    # Qwen3-Coder's 2048-token forward, worked by hand from its config.json's shape:
    # per layer q, k, v, o; 8 of 128 experts' gate, up and down; the router; causal
    # attention (QK^T and AV, 2 FLOPs per MAC); the LM head on the last position.
    layers, hidden, heads, kv_heads, head_dim, vocab = 48, 2048, 32, 4, 128, 151936
    experts, top_k, inter, tokens = 128, 8, 768, 2048
    per_token = layers * (
        2 * hidden * heads * head_dim
        + 2 * hidden * kv_heads * head_dim
        + top_k * 3 * hidden * inter
        + hidden * experts
    )
    attention = 4 * heads * head_dim * layers * tokens * (tokens + 1) / 2
    flops = 2 * tokens * per_token + attention + 2 * hidden * vocab
    coder = data["models"]["qwen3-coder-30b-a3b"]
    assert coder["forward_2048"]["flops"] == flops
    # A roofline never beats its compute bound: 8k tokens on the Spark and on the Mac.
    at_8k = coder["scenarios"]["8k prompt"]
    tokens = at_8k["tokens"]
    flops_8k = 2 * tokens * per_token + 4 * heads * head_dim * layers * tokens * (tokens + 1) / 2
    assert at_8k["spark_prefill_s"] >= flops_8k / data["devices"]["gb10"]["flops"]
    assert at_8k["mac_prefill_s"] >= flops_8k / data["devices"]["m3-ultra"]["flops"]

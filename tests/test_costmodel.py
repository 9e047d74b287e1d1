"""The cost model (disagg_agents.models.cost, disagg.bench.costmodel): counts against a
small case worked by hand; the efficiencies refitted from the published points and
each point reproduced; EXO's published split; each MoE path's terms; the
placement's prior; `disagg plan` quick by default, whole at 80 columns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.bench import costmodel
from disagg.bench.costmodel import POINTS, SHAPES, exo_check, fit, predicted_tokens_per_s
from disagg_agents.decode.placement import Placement
from disagg_agents.models.cost import (
    DEVICES,
    EFFICIENCY,
    Prior,
    Shape,
    attention_flops,
    auto_path,
    experts_hit,
    kv_bytes,
    layer_paths,
    moe_blocks,
    moe_traffic,
    prefill_flops,
    prefill_terms,
    prior,
    roofline_s,
    weight_bytes,
)
from disagg_agents.models.moecost import (
    KERNEL_EFFICIENCY,
    Pick,
    expected_blocks,
    kernel_tiles,
    layer_traffic,
    recording_pick,
)
from disagg_agents.models.moetiles import GB10, H200, Tiles, row_reads

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


def test_the_fit_gives_the_efficiencies_in_the_code() -> None:
    """EFFICIENCY holds the fit's output rounded: refitting the published points
    gives it back, so a changed point or shape cannot leave a stale constant."""
    fitted = fit()
    assert set(fitted) == {"gb10", "m3-ultra", "m4-max"}
    for device, values in fitted.items():
        for field, value in values.items():
            assert getattr(EFFICIENCY[device], field) == pytest.approx(value, rel=0.01), (
                device,
                field,
            )


@pytest.mark.parametrize("p", POINTS, ids=lambda p: f"{p.device}-{p.model}-{p.kind}-{p.context}")
def test_the_model_reproduces_each_published_point(p: costmodel.Point) -> None:
    """Prefill points within 10 % (two parameters per device fit 4-10 points); decode
    within 30 %: one bandwidth share for both MoE models on the Spark, whose llama.cpp
    tg32 figures differ by 25 % (GGUF's non-expert tensors are not counted bit-exact)."""
    assert p.source
    tolerance = 0.10 if p.kind == "prefill" else 0.30
    assert predicted_tokens_per_s(p) == pytest.approx(p.tokens_per_s, rel=tolerance)


def test_exo_published_split_within_30_percent() -> None:
    """EXO: Llama-3.1-8B FP16, 8k prompt, 32 tokens, Spark + M3 Ultra over 10 GbE: 2.8x
    the Mac alone. Both dense prefill rates were fitted to EXO's own table, so what
    this checks is the rest: K/V streamed per layer over 1.1 GB/s, and decode."""
    check = exo_check()
    assert check["speedup"] == pytest.approx(2.8, rel=0.30)
    # With the Spark's dense rate from llama.cpp's Q8_0 kernels it is not within: an
    # engine at ~30 % of the Spark's FP16 peak, where EXO's ran near it (docs say so).
    assert check["speedup_llamacpp_spark"] < 2.8 * 0.7


def test_moe_paths_on_the_spark() -> None:
    """Issue 44's reading of the blocked path at 8k on Qwen3-Coder: ~1,150 blocks of
    64 rows, one bf16 expert copy written and read per block: ~11 GB a layer, seconds
    per prefill; the fused kernel adds no such bytes; grouped_mm's fallback syncs."""
    s = SHAPES["qwen3-coder-30b-a3b"]
    assert moe_blocks(s, 8192) == (65536 + 128 * 63) / 64 == 1150
    blocked = prefill_terms(s, 8192, "gb10", "blocked")
    per_layer = blocked["extra_s"] * DEVICES["gb10"].bandwidth / s.layers
    assert per_layer == pytest.approx(1150 * 3 * 2048 * 768 * 2 * 2, rel=1e-9)  # 10.9 GB
    assert blocked["extra_s"] > 1.0
    triton = prefill_terms(s, 8192, "gb10", "triton")
    assert triton["extra_s"] == 0 and triton["overhead_s"] == 0
    assert blocked["total_s"] > triton["total_s"]
    grouped = prefill_terms(s, 8192, "gb10", "grouped")  # sm_121: torch's host loop
    assert grouped["overhead_s"] >= 3 * s.layers * DEVICES["gb10"].sync_s
    assert (auto_path("gb10"), auto_path("h100-sxm"), auto_path("m4-max")) == (
        "triton",
        "grouped",  # torch's fast kernel runs on sm90
        "mlx",
    )
    # GPT-OSS packed: every block dequantizes its own expert copy (~8 TB at 8k).
    g = SHAPES["gpt-oss-120b"]
    packed = prefill_terms(g, 8192, "gb10", "blocked")["extra_s"] * DEVICES["gb10"].bandwidth
    assert 6e12 < packed < 8e12  # 7.2 TB
    # Eager attention at 32k: two [64, 32k, 32k] bf16 tensors do not fit 128 GB.
    assert prefill_terms(g, 32768, "gb10", "triton", eager=True)["fits"] == 0
    assert prefill_terms(g, 8192, "gb10", "triton", eager=True)["fits"] == 1


# --- the fused kernel's own figures ----------------------------------------------------

FIGURES = costmodel.recorded_layers()


def test_the_recorded_runs_are_read_and_the_kernel_efficiency_is_refit_from_them() -> None:
    """Every fused-kernel layer of the H200 run, one efficiency for the arch fitted
    to all of them at once: the constant in the code."""
    assert {(f.model, f.tokens) for f in FIGURES} == {
        (m, n) for m in ("qwen3-coder-30b-a3b", "gpt-oss-120b") for n in (2048, 8192)
    }
    fitted = costmodel.fit_kernel(FIGURES)
    assert fitted == {"sm90": pytest.approx(KERNEL_EFFICIENCY["sm90"].padded, abs=5e-4)}


@pytest.mark.parametrize("f", FIGURES, ids=lambda f: f"{f.model}-{f.tokens}")
def test_the_model_predicts_each_recorded_h200_layer_within_30_percent(
    f: costmodel.LayerFigure,
) -> None:
    # Predicted at the tiles and 2-D grid that run used (before the per-device table).
    s = SHAPES[f.model]
    ran = recording_pick(f.tokens * s.top_k, s.experts)
    assert costmodel.figure_tiles(f) == ran and ran.gate_up.group_m == 0
    # The bytes the bench counted as the least a layer moves: the model's own count.
    assert moe_traffic(s, f.tokens, f.device, ran).min_bytes == pytest.approx(f.min_bytes, 1e-6)
    assert costmodel.predicted_layer_ms(f) == pytest.approx(f.ms, rel=0.30)


def test_the_kernels_traffic_by_hand() -> None:
    """128 experts, top-8, one token: 8 blocks (empty experts skipped), 8 experts'
    packed weights read, not 128. Many tokens: the 2-D grid re-reads a block's rows
    per output tile; the N-fastest order the kernel runs reads them once."""
    one = layer_traffic(1, 2048, 768, 128, 8, 4.5, kernel_tiles(GB10, 8, 128))
    assert one.blocks == pytest.approx(8, rel=1e-9)
    assert one.weight_bytes == pytest.approx(8 * 3 * 2048 * 768 * 4.5 / 8)
    assert one.padded_flops == 16 * one.flops  # 16-row blocks for one pair each
    # 256 pairs an expert on average: one 512-row block each; 128-row blocks, two or
    # three (about half the experts get more than the mean).
    assert expected_blocks(4096, 8, 128, 512) == pytest.approx(128, rel=1e-6)
    assert 128 * 2.4 < expected_blocks(4096, 8, 128, 128) < 128 * 2.6
    grid = Tiles(128, 128, 64, 8, 3, group_m=0)
    many = layer_traffic(8192, 2048, 768, 128, 8, 4.5, Pick(grid, grid))
    swz = Tiles(128, 128, 64, 8, 3, group_m=1)
    once = layer_traffic(8192, 2048, 768, 128, 8, 4.5, Pick(swz, swz))
    rows = many.blocks * 128 * 2
    assert many.act_bytes - once.act_bytes == pytest.approx(rows * (2048 * 5 + 768 * 15))
    # On the Spark the fused path's layer time is the kernel's, at sm90's figure until
    # a GB10 runs it; the plan says so.
    paths = layer_paths(SHAPES["gpt-oss-120b"], "gb10")
    assert paths["MoE experts"].startswith("triton") and "taken from sm90" in paths["MoE experts"]
    assert "window 128" in paths["sliding attention"]
    assert "sliding attention" not in layer_paths(SHAPES["qwen3-coder-30b-a3b"], "gb10")
    h200 = layer_paths(SHAPES["gpt-oss-120b"], "h200", "triton")
    assert "measured on sm90" in h200["MoE experts"]


def test_the_plan_counts_the_tiles_and_order_the_kernel_picks_on_the_target() -> None:
    """`disagg plan` predicts the Spark with the table's tiles on a GB10's numbers
    (64-row blocks at 8k tokens, N-fastest), the H200 with its own; a row block's
    activations come back as the launch order brings them (the order the kernels'
    swizzle runs, tests/test_moe_triton.py)."""
    s = SHAPES["qwen3-coder-30b-a3b"]
    for device, props in (("gb10", GB10), ("h200", H200)):
        pick = kernel_tiles(props, 8192 * 8, 128)
        got = moe_traffic(s, 8192, device)
        assert got == layer_traffic(8192, 2048, 768, 128, 8, 4.5, pick)
    assert kernel_tiles(GB10, 8192 * 8, 128).gate_up.bm == 64
    assert kernel_tiles(H200, 8192 * 8, 128).gate_up.bm == 128
    # Rows once per block in the N-fastest order (or a group's), once per N tile in
    # the 2-D grid: the kernel's order re-reads nothing the layer's old grid did.
    assert (row_reads(6, 1), row_reads(6, 4), row_reads(6, 0)) == (1, 1, 6)
    old = moe_traffic(s, 8192, "gb10", recording_pick(8192 * 8, 128))
    assert moe_traffic(s, 8192, "gb10").act_bytes < old.act_bytes


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


def test_plan_is_quick_by_default(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No model is built unless --count-layers asks: the default answers from the
    model alone, with both user models at 2k-64k and where the split starts to win."""

    def no_counting(*_: Any, **__: Any) -> Any:
        raise AssertionError("plan built a model without --count-layers")

    monkeypatch.setattr(costmodel, "count", no_counting)
    done = cli("plan", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert "not a measurement" in data["note"]
    assert set(data["models"]) == {"qwen3-coder-30b-a3b", "gpt-oss-120b"}
    for m in data["models"].values():
        assert [p["tokens"] for p in m["prompts"]] == [2048, 8192, 32768, 65536]
        assert m["crossover_tokens"] and all(p["speedup"] > 0 for p in m["prompts"])
        assert m["layer_paths"]["MoE experts"].startswith("triton")
    assert data["exo_check"]["published"] == 2.8
    table = cli("plan", "--mac", "m4-max", "--link", "tb5")
    assert table.returncode == 0, table.stderr
    assert "M4 Max" in table.stdout and "65,536" in table.stdout
    assert "The split wins from" in table.stdout
    assert "On the Spark: MoE experts: triton" in " ".join(table.stdout.split())
    bad = cli("plan", "--mac", "m2-ultra")
    assert bad.returncode == 1 and "m3-ultra, m4-max" in bad.stderr


def test_plan_speaks_the_users_words_whole_at_80_columns(
    cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from disagg.cli import common

    monkeypatch.setattr(common.out, "_width", 80)  # as an 80-column terminal
    for args in (["plan", "--help"], ["plan"]):
        done = cli(*args, env={"COLUMNS": "80"})
        assert done.returncode == 0, done.stderr
        text = done.stdout.lower()
        assert "grader" not in text and "rubric" not in text
        assert "…" not in done.stdout  # rich's mark for text cut short
        assert max(len(line) for line in done.stdout.splitlines()) <= 80
        assert "--count-layers" in done.stdout or "split wins" in done.stdout


def test_counted_launches_add_to_the_spark_prefill() -> None:
    """With --count-layers, the ops and syncs counted here (per layer, scaled to the
    real layer count) add their launch and sync costs to the Spark's prefill."""
    counts = costmodel.Counts(104, 1, 34, 0, 63, 0, 2, "kept")
    plain = costmodel.scenario("qwen3-coder-30b-a3b", 8192, "m3-ultra", "10gbe")
    counted = costmodel.scenario("qwen3-coder-30b-a3b", 8192, "m3-ultra", "10gbe", counts=counts)
    d = DEVICES["gb10"]
    added = (48 * 104 + 63) * d.launch_s + 48 * 1 * d.sync_s
    assert counted["spark_prefill_s"] - plain["spark_prefill_s"] == pytest.approx(added)
    assert costmodel.plan(counts={"gpt-oss-120b": counts})["models"]["gpt-oss-120b"]["counts"]

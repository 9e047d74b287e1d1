"""The benchmark runs end to end on the default model (tiny settings): it checks
the bench works and reports numbers that must hold on any machine (same tokens as
the references, time parts inside the whole), never the speed bars or their verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from disagg.bench.core import bench_table, run_core_bench
from tests.benchcheck import positive, run_section

pytestmark = pytest.mark.slow


def test_core_bench_runs(default_model: Path, pooled_bench_pairs: None) -> None:
    report, _ = run_section(
        run_core_bench, default_model, repeats=1, decode_tokens=8, long_prompt_tokens=300
    )

    assert report["settings"] == {"repeats": 1, "decode_tokens": 8, "long_prompt_tokens": 300}
    assert report["model"] == str(default_model)
    assert report["date"]
    machine = report["machine"]
    for key in ("platform", "cpu_count", "torch", "transformers", "mlx", "mlx_lm"):
        assert machine[key], key
    assert machine["prefill_device"] and machine["decode_device"]

    d = report["decode"]
    assert d["tokens"] == 8 and d["prompt_tokens"] > 1
    assert len(d["agent_tok_s"]) == len(d["mlx_lm_tok_s"]) == 1
    for key in ("agent_median_tok_s", "mlx_lm_median_tok_s", "ratio"):
        assert positive(d[key]), key
    assert all(positive(x) for x in d["agent_tok_s"] + d["mlx_lm_tok_s"])
    assert d["same_tokens"] is True  # greedy: the agent decodes what mlx-lm decodes

    t = report["ttft"]
    assert abs(t["prompt_tokens"] - 300) <= 9
    assert len(t["disagg_ttft_s"]) == len(t["transformers_prefill_s"]) == 1
    for key in ("disagg_median_s", "transformers_median_s", "ratio"):
        assert positive(t[key]), key
    assert t["same_first_token"] is True
    b = t["breakdown"]
    for key in ("agent_ttft", "prefill_time", "kv_wait_time", "kv_transfer_time", "kv_bytes"):
        assert positive(b[key]), key
    assert isinstance(b["kv_bytes"], int)
    # Parts of the time to first token are inside it, whatever the machine's speed.
    assert b["prefill_time"] <= b["agent_ttft"] and b["kv_transfer_time"] <= b["agent_ttft"]
    # SmolLM2-135M's K and V: 30 layers x 3 KV heads x 64 dims, at least a byte each
    # (minus what the prefix cache already held), frames add headers on top.
    assert b["kv_bytes"] >= 30 * 2 * 3 * 64 * 16

    assert isinstance(report["ok"], bool)  # the verdict is the bench's, not a test's
    assert positive(report["elapsed_s"])
    assert set(report["load_avg_1m"]) == {"start", "end"}

    console = Console(record=True, width=160)
    console.print(bench_table(report))
    text = console.export_text()
    assert "agent / mlx-lm" in text and "TTFT / transformers prefill" in text


def test_bad_settings(default_model: Path) -> None:
    with pytest.raises(ValueError):
        run_core_bench(default_model, repeats=0)
    with pytest.raises(ValueError):
        run_core_bench(default_model, decode_tokens=1)


def test_formats_bench_runs(
    default_model: Path, pooled_bench_pairs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`disagg bench formats` beyond --help: every constrained answer valid, the
    figures consistent with each other (the speed itself is not judged here). Its
    long-reason schemas shortened, so 24 tokens finish each answer on a small box; its
    smallest real batches (1 and 4: rows at once, as 16 would be, at a quarter the cost)."""
    import disagg.bench.formats as formats
    from disagg.bench.formats import formats_table, run_formats_bench

    def short_schema(i: int) -> dict[str, Any]:
        s = json.loads(json.dumps(formats.GRADER))
        s["properties"]["reason"] = {"type": "string", "maxLength": 4}
        s["properties"]["score"]["maximum"] = 10 + i
        return s

    monkeypatch.setattr(formats, "long_schema", short_schema)
    report, _ = run_section(
        run_formats_bench, default_model, new_tokens=24, repeats=1, batches=(1, 4)
    )
    assert report["settings"] == {"new_tokens": 24, "repeats": 1}
    assert positive(report["compile_cold_ms"]) and report["compile_hit_ms"] >= 0
    assert sorted(report["batches"]) == ["1", "4"], report
    for size, b in report["batches"].items():
        assert b["all_valid"] is True, size  # every JSON answer met its schema
        assert b["ratio"] == pytest.approx(b["json_tok_s"] / b["free_tok_s"])
        assert 0 < b["json_tokens_mean"] <= 24, b
        assert positive(b["free_total_tok_s"]) and positive(b["json_total_tok_s"])
    console = Console(width=200, record=True, color_system=None)
    console.print(formats_table(report))
    assert "compile" in console.export_text().lower()


def test_stall_bench_runs(default_model: Path, pooled_bench_pairs: None) -> None:
    """`disagg bench stall` beyond --help: the prompt it prefilled was the size asked,
    the longest gap is a gap the stream had, and the batch rows add up (4 streams of
    16 tokens against 1: the smallest real batch)."""
    from disagg.bench.stall import run_stall_bench, stall_table

    report, _ = run_section(
        run_stall_bench, default_model, prompt_tokens=300, streams=4, stream_tokens=16
    )
    s = report["stall"]
    assert abs(s["prompt_tokens"] - 300) <= 9, s
    assert positive(s["prefill_s"]) and positive(s["longest_gap_s"])
    assert s["gap_vs_prefill"] == pytest.approx(s["longest_gap_s"] / s["prefill_s"])
    assert s["tokens_during_prefill"] >= 0
    one, four = report["batch"]
    assert (one["requests"], four["requests"]) == (1, 4), report["batch"]
    assert report["batch_4_vs_1"] == pytest.approx(four["aggregate_tok_s"] / one["aggregate_tok_s"])
    console = Console(width=200, record=True, color_system=None)
    console.print(stall_table(report))
    assert "4 streams / 1" in console.export_text()

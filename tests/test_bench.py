"""The benchmark runs end to end on the default model (tiny settings): it checks
the bench works and reports sane numbers, not the speed bars."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from disagg.bench.core import bench_table, run_core_bench
from tests.benchcheck import positive, run_section

pytestmark = pytest.mark.slow


def test_core_bench_runs(default_model: Path) -> None:
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
    assert d["ok"] == (d["ratio"] >= d["bar"])
    assert d["same_tokens"] is True  # greedy: the agent decodes what mlx-lm decodes

    t = report["ttft"]
    assert abs(t["prompt_tokens"] - 300) <= 9
    assert len(t["disagg_ttft_s"]) == len(t["transformers_prefill_s"]) == 1
    for key in ("disagg_median_s", "transformers_median_s", "ratio"):
        assert positive(t[key]), key
    assert t["ok"] == (t["ratio"] <= t["bar"])
    assert t["same_first_token"] is True
    b = t["breakdown"]
    for key in ("agent_ttft", "prefill_time", "kv_wait_time", "kv_transfer_time", "kv_bytes"):
        assert positive(b[key]), key
    assert isinstance(b["kv_bytes"], int)

    assert report["ok"] == (d["ok"] and t["ok"])
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

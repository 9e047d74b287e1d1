"""The benchmark runs end to end on the default model (tiny settings): it checks
the bench works and reports numbers that must hold on any machine (same tokens as
the references, time parts inside the whole), never the speed bars or their verdicts."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
from rich.console import Console

from disagg.bench.core import bench_table, run_core_bench
from tests.benchcheck import positive, run_section

pytestmark = pytest.mark.slow


@pytest.fixture
def shared_references(monkeypatch: pytest.MonkeyPatch, refs: Any, default_model: Path) -> None:
    """The benches' in-process mlx-lm and transformers models of the default model are
    the session's (`refs`: the same loads, mlx-lm's `load` and transformers' float32
    model in eval mode), loaded once rather than once per bench: the benches measure
    them, not their loading. Any other load goes through as asked."""
    import mlx_lm
    import torch
    from transformers import AutoModelForCausalLM

    ours = refs.mlx_load(default_model), refs.hf(default_model)  # loaded before the patch
    mlx_load, hf_load = mlx_lm.load, AutoModelForCausalLM.from_pretrained

    def mlx(path: Any, *args: Any, **kw: Any) -> Any:
        if Path(path) == default_model and not args and not kw:
            return ours[0]
        return mlx_load(path, *args, **kw)

    def hf(path: Any, *args: Any, **kw: Any) -> Any:
        if Path(path) == default_model and not args and kw == {"dtype": torch.float32}:
            return ours[1]
        return hf_load(path, *args, **kw)

    monkeypatch.setattr(mlx_lm, "load", mlx)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", hf)


def test_core_bench_runs(
    default_model: Path, pooled_bench_pairs: None, shared_references: None
) -> None:
    report, _ = run_section(
        run_core_bench, default_model, repeats=1, decode_tokens=4, long_prompt_tokens=300
    )

    assert report["settings"] == {"repeats": 1, "decode_tokens": 4, "long_prompt_tokens": 300}
    assert report["model"] == str(default_model)
    assert report["date"]
    machine = report["machine"]
    for key in ("platform", "cpu_count", "torch", "transformers", "mlx", "mlx_lm"):
        assert machine[key], key
    assert machine["prefill_device"] and machine["decode_device"]

    d = report["decode"]
    assert d["tokens"] == 4 and d["prompt_tokens"] > 1
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
    long-reason schemas shortened, so 24 tokens finish each answer on a small box (the
    bench allows a constrained answer 4 x new_tokens: 12 free tokens, 48 for JSON); its
    smallest real batches (1 and 2: rows at once, as 16 would be, at an eighth the cost)."""
    import disagg.bench.formats as formats
    from disagg.bench.formats import formats_table, run_formats_bench

    def short_schema(i: int) -> dict[str, Any]:
        s = json.loads(json.dumps(formats.GRADER))
        s["properties"]["reason"] = {"type": "string", "maxLength": 4}
        s["properties"]["score"]["maximum"] = 10 + i
        return s

    monkeypatch.setattr(formats, "long_schema", short_schema)
    report, _ = run_section(
        run_formats_bench, default_model, new_tokens=12, repeats=1, batches=(1, 2)
    )
    assert report["settings"] == {"new_tokens": 12, "repeats": 1}
    assert positive(report["compile_cold_ms"]) and report["compile_hit_ms"] >= 0
    assert sorted(report["batches"]) == ["1", "2"], report
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
    the longest gap is a gap the stream had, and the batch rows add up (2 streams of
    8 tokens against 1: the smallest real batch)."""
    from disagg.bench.stall import run_stall_bench, stall_table

    report, _ = run_section(
        run_stall_bench, default_model, prompt_tokens=150, streams=2, stream_tokens=8
    )
    s = report["stall"]
    assert abs(s["prompt_tokens"] - 150) <= 9, s
    assert positive(s["prefill_s"]) and positive(s["longest_gap_s"])
    assert s["gap_vs_prefill"] == pytest.approx(s["longest_gap_s"] / s["prefill_s"])
    assert s["tokens_during_prefill"] >= 0
    one, two = report["batch"]
    assert (one["requests"], two["requests"]) == (1, 2), report["batch"]
    assert report["batch_2_vs_1"] == pytest.approx(two["aggregate_tok_s"] / one["aggregate_tok_s"])
    console = Console(width=200, record=True, color_system=None)
    console.print(stall_table(report))
    assert "2 streams / 1" in console.export_text()


SERVING = {
    "lengths": (16, 32),
    "tokens": 2,  # the fewest that time a TPOT
    "repeats": 1,
    "concurrency": (1, 4),
    "concurrency_tokens": 4,
}


def test_serving_bench_runs(
    default_model: Path, pooled_bench_pairs: None, shared_references: None, tmp_path: Path
) -> None:
    """`disagg bench serving` beyond --help, at its smallest real settings (two short
    prompts, 2 tokens, 1 and 4 requests at once): each system's figures present and
    consistent, the memory figures in proportion, the concurrency rows what was sent,
    the tables and the chart drawn. The speed and the bars' verdicts are not judged."""
    from disagg.bench.serving import run_serving_bench, serving_tables, ttft_chart

    report, said = run_section(run_serving_bench, default_model, **SERVING)
    assert report["settings"] == {
        **SERVING,
        "lengths": [16, 32],
        "concurrency": [1, 4],
        "mlx_repeats": 1,
        "mlx_cap_s": 300.0,
    }
    assert any("memory" in line for line in said) and any("concurrency" in line for line in said)
    _check_serving_latency(report["latency"])
    _check_serving_memory(report["memory"], default_model)
    _check_serving_concurrency(report["concurrency"])

    console = Console(width=240, record=True, color_system=None)
    for t in serving_tables(report):
        console.print(t)
    text = console.export_text()
    assert "TTFT and TPOT (2 new tokens, greedy)" in text
    for row in report["latency"]:
        assert f" {row['prompt_tokens']} " in text
    assert "Decode agent memory" in text and "Concurrent requests" in text
    png = ttft_chart(report, tmp_path / "ttft.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _NoInProcessMlx:
    """Systems for `mlx_latency` alone: the weights and length, and no in-process
    mlx-lm (a length past the cap must never run there)."""

    def __init__(self, model_dir: Path, tokens: int) -> None:
        self.model_dir, self.tokens = model_dir, tokens

    def mlx_once(self, ids: list[int]) -> dict[str, Any]:
        raise AssertionError("a length projected past the cap ran in process")


def _mlx_children() -> list[int]:
    """Our child processes running the bench's mlx-lm script."""
    from disagg.bench.serving import MLX_CHILD

    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if MLX_CHILD.strip()[:40] in " ".join(child.cmdline()):
                found.append(child.pid)
    return found


def test_a_length_past_the_mlx_cap_runs_mlx_lm_in_a_child(default_model: Path, refs: Any) -> None:
    """`bench serving`'s child-process path: a length whose projected mlx-lm TTFT passes
    the cap runs in a child, marked so in its row, with mlx-lm's own first token (an
    in-process mlx-lm run is the reference) and all its tokens."""
    from disagg.bench.serving import Systems, mlx_latency
    from tests.references import mlx_greedy

    ids = [1, 504, 3458, 282, 4649, 314, 2]  # token ids in SmolLM2's vocabulary
    row: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    said: list[str] = []
    systems = cast(Systems, _NoInProcessMlx(default_model, 2))
    rate = mlx_latency(systems, ids, 1.0, 1.0, row, runs, said.append)  # 7 s projected > 1 s
    assert rate == 1.0 and row == {"mlx_lm_child_process": True}, row
    assert "child process" in said[0] and "projected TTFT 7 s" in said[0], said
    [first] = mlx_greedy(refs.mlx(default_model), ids, 1)
    assert runs[0]["first_token"] == first and runs[0]["tokens"] == 2, runs
    assert positive(runs[0]["ttft_s"]) and positive(runs[0]["tpot_s"]), runs
    assert _mlx_children() == []


def test_an_mlx_lm_child_past_its_cap_is_killed_and_marked(default_model: Path) -> None:
    """The cap is enforced: a child that outlives cap + load slack is killed, reaped, and
    the row says so; nothing is left running."""
    from disagg.bench.serving import mlx_capped

    t0 = time.monotonic()
    got = mlx_capped(default_model, [1, 504, 3458], 4000, cap_s=0.0, load_slack_s=0.5)
    took = time.monotonic() - t0
    assert isinstance(got, str) and got.startswith("capped: killed after"), got
    assert "cap 0 s + 0 s for loading" in got and "without its 4000 tokens" in got, got
    assert took >= 0.5  # it was given its slack, not refused outright
    assert _mlx_children() == []


def _check_serving_latency(latency: list[dict[str, Any]]) -> None:
    """A row per length, each system's TTFT and TPOT from its runs; every run made
    all its tokens, and the handoff's prefill inside its TTFT."""
    assert [row["target"] for row in latency] == [16, 32]
    for row in latency:
        assert row["target"] - 9 <= row["prompt_tokens"] <= row["target"], row
        assert "mlx_lm_capped" not in row and "mlx_lm_child_process" not in row
        assert row["same_first_token"] is True  # greedy, the same weights
        for system, n_runs in (("disagg", 1), ("transformers", 1), ("mlx_lm", 1)):
            runs = row[system]["runs"]
            assert len(runs) == n_runs, (system, row)
            assert row[system]["ttft_s"] == runs[0]["ttft_s"]  # the median of one
            assert row[system]["tpot_s"] == runs[0]["tpot_s"]
            for r in runs:
                assert r["tokens"] == 2 and positive(r["ttft_s"]) and positive(r["tpot_s"]), r
        for r in row["disagg"]["runs"]:
            assert positive(r["kv_bytes"]) and positive(r["prefill_time"]), r
            assert r["prefill_time"] <= r["ttft_s"], r  # client-observed TTFT holds it


def _check_serving_memory(mem: dict[str, Any], model_dir: Path) -> None:
    """The decode agent's RSS around one 32-token handoff: the peak at least the
    baseline, the weights inside it, the K/V what the prompt's tokens make."""
    assert "error" not in mem, mem
    n = mem["prompt_tokens"]
    assert 32 - 9 <= n <= 32
    assert mem["peak_rss"] >= mem["baseline_rss"] > 0
    assert mem["growth"] == mem["peak_rss"] - mem["baseline_rss"]
    assert mem["model_bytes"] == sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    # SmolLM2-135M's K and V: 30 layers x 2 x 3 KV heads x 64 dims per token, at
    # least a byte and at most 4 each (fp32), frames' headers a fraction on top.
    per_token = 30 * 2 * 3 * 64
    assert per_token * n <= mem["kv_bytes"] <= 1.25 * 4 * per_token * n, mem
    assert mem["kv_bytes"] < mem["model_bytes"] < mem["peak_rss"]
    assert mem["growth_over_kv"] == pytest.approx(mem["growth"] / mem["kv_bytes"])
    assert isinstance(mem["ok"], bool) and isinstance(mem["ok_literal"], bool)
    assert "cache_on_error" not in mem, mem
    assert mem["cache_on_growth_over_kv"] == pytest.approx(mem["cache_on_growth"] / mem["kv_bytes"])
    kept = mem["cache_on_growth"] - mem["cache_on_stored"]
    assert mem["cache_on_transient_over_kv"] == pytest.approx(kept / mem["kv_bytes"])


def _check_serving_concurrency(conc: dict[str, Any]) -> None:
    """A row per concurrency, each with every request answered in full and its
    aggregate against the single stream's."""
    runs = conc["runs"]
    assert [c["requests"] for c in runs] == [1, 4]
    for c in runs:
        assert c["errors"] == [], c
        assert c["completion_tokens"] == 4 * c["requests"], c
        for key in ("aggregate_tok_s", "end_to_end_tok_s", "per_request_decode_tok_s"):
            assert positive(c[key]), (key, c)
        assert 0 < c["decode_window_s"] <= c["wall_s"], c
        assert c["end_to_end_tok_s"] == pytest.approx(c["completion_tokens"] / c["wall_s"])
        assert 0 < c["ttft_p50_s"] <= c["ttft_max_s"] <= c["wall_s"], c
    assert runs[0]["vs_single"] == pytest.approx(1.0)
    assert runs[1]["vs_single"] == pytest.approx(
        runs[1]["aggregate_tok_s"] / runs[0]["aggregate_tok_s"]
    )
    assert isinstance(conc["ok"], bool) and conc["bar"] == 4.0

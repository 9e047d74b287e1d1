"""The wire and compression benchmark runs end to end on real KV of the default
model at small sizes: structure and sanity (positive, finite, bit-exact), not
the speed bars. Plus the pipeline arithmetic it rests on."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from disagg.bench.wire import (
    CODECS,
    HANDOFF_PAIRS,
    pipeline_time,
    run_wire_bench,
    wire_tables,
)
from tests.benchcheck import positive, run_section


def test_pipeline_time() -> None:
    assert pipeline_time([]) == 0.0
    assert pipeline_time([[1.0, 2.0, 3.0]]) == 6.0  # one item: the stages in a row
    # the bottleneck stage sets the pace: 3 items x 2 s + the others' fill/drain
    assert pipeline_time([[1.0, 2.0, 1.0]] * 3) == 1.0 + 3 * 2.0 + 1.0
    # never faster than the busiest stage, never slower than everything in series
    items = [[0.3, 1.0, 0.2], [0.5, 0.1, 0.9], [0.2, 0.4, 0.4]]
    t = pipeline_time(items)
    assert max(sum(col) for col in zip(*items, strict=True)) <= t <= sum(map(sum, items))


@pytest.mark.slow
def test_wire_bench_runs(default_model: Path) -> None:
    report, _ = run_section(run_wire_bench, default_model, tokens=48, repeats=1, codec_repeats=1)
    Console(file=None, width=200, record=True).print(*wire_tables(report))

    assert set(report["dtypes"]) == {"float32", "bfloat16"}
    for dtype, p in report["dtypes"].items():
        itemsize = 4 if dtype == "float32" else 2
        assert p["layers"] == 30 and abs(p["prompt_tokens"] - 48) <= 3
        # SmolLM2-135M: 3 KV heads x 64 dims, K and V, every layer
        assert p["raw_bytes"] == 30 * p["prompt_tokens"] * 3 * 64 * 2 * itemsize
        assert p["bit_exact"] and p["bit_exact_compressed"] and p["json_bit_exact"]
        assert p["inplace_bit_exact"] and p["mlx_copy_bit_exact"]
        assert positive(p["inplace_vs_bare"]) and positive(p["mlx_copy_vs_bare"])
        assert positive(p["inplace_vs_bare_asked"])
        # one repetition: HANDOFF_PAIRS bare / bare asked / ours / in-place runs, a ratio each
        assert len(p["inplace_vs_bare_runs"]) == HANDOFF_PAIRS and p["inplace_bar"] == 0.95
        assert len(p["inplace_vs_bare_asked_runs"]) == HANDOFF_PAIRS
        assert len(p["ours_vs_bare_runs"]) == HANDOFF_PAIRS  # ours in the same pairs
        assert p["ok_inplace"] == (p["inplace_vs_bare"] >= 0.95)
        assert positive(p["inplace_request_s"]) and positive(p["inplace_alloc_s"])
        assert p["inplace_request_s"] < p["median_s"]["ours_inplace"]
        assert p["inplace_stream_vs_bare"] > p["inplace_vs_bare"]
        keys = ("ours", "bare", "bare_asked", "json", "ours_zstd", "ours_shuffle_zstd")
        for key in (*keys, "ours_inplace", "ours_mlx_copy"):
            assert positive(p["gb_s"][key]), key
            paired = key in ("bare", "bare_asked", "ours", "ours_inplace")
            assert len(p["seconds"][key]) == (HANDOFF_PAIRS if paired else 1), key
        assert p["wire_bytes"]["bare"] == p["wire_bytes"]["bare_asked"] == p["raw_bytes"]
        assert p["wire_bytes"]["ours"] > p["raw_bytes"]  # headers
        assert p["wire_bytes"]["ours_inplace"] == p["wire_bytes"]["ours"]  # the same frames
        assert p["wire_bytes"]["json"] > 4 / 3 * p["raw_bytes"]  # base64

        c = p["compression"]
        assert set(c["codecs"]) == {name for name, _, _ in CODECS}
        assert c["codecs"]["off"]["ratio"] < 1.0  # framing only
        for name, m in c["codecs"].items():
            assert positive(m["ratio"]) and positive(m["encode_s"]) and positive(m["decode_s"])
            assert m["raw_bytes"] == p["raw_bytes"]
            if name != "off":
                assert m["ratio"] > 1.0, name  # real KV does compress somewhat
        assert set(c["rates_gbit"]) == {"1", "10"}
        for r in c["rates_gbit"].values():
            for m in r["codecs"].values():
                assert positive(m["pipelined_s"])
                assert m["wire_only_s"] <= m["pipelined_s"] <= m["serial_s"] + 1e-12
            a = r["adaptive"]
            assert a["codec"] in c["codecs"]
            assert a["never_slower"] and a["pipelined_s"] <= r["codecs"]["off"]["pipelined_s"]
        assert c["adaptive_never_slower"]
    # The verdict is the bench's (its speed bars), not this test's; it must follow from
    # its parts: exactness holds (asserted above), so it is the bars' conjunction.
    bars = [p[k] for p in report["dtypes"].values() for k in ("ok_bare", "ok_json", "ok_inplace")]
    bars += [p["compression"]["adaptive_ok_1gbit"] for p in report["dtypes"].values()]
    assert all(isinstance(b, bool) for b in bars)
    assert report["ok"] is all(bars)

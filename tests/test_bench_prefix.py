"""`disagg bench prefix` end to end on the default model, small settings: it
runs and its numbers are consistent, not the speed bars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from disagg.bench.prefix import prefix_table, run_prefix_bench

pytestmark = pytest.mark.slow


def test_prefix_bench_runs(default_model: Path, pooled_bench_pairs: None) -> None:
    messages: list[str] = []
    r = run_prefix_bench(
        default_model,
        prefix_tokens=400,
        suffix_tokens=60,
        requests=2,
        new_tokens=8,
        say=messages.append,
    )
    json.dumps(r)
    assert messages and r["same_tokens"] is True
    assert r["shared_tokens"] >= 400
    # 16: disagg_agents.prefix.store.BLOCK_TOKENS
    assert r["cached_tokens_mean"] >= r["shared_tokens"] - 16
    assert 0 < r["kv_bytes_on"] < r["kv_bytes_off"]
    assert r["kv_bytes_ratio"] < 1.5  # 60-token suffixes: a block of rounding is 25 %
    assert len(r["ttft_off_s"]) == len(r["ttft_on_s"]) == 2
    Console(width=120, record=True).print(prefix_table(r))

"""`disagg bench load` at its quick size, end to end: a real `disagg serve` (a fleet's
gateway over the pooled SmolLM2 agents, given to the bench with `url`) and a real
mlx_lm.server on the default model, driven over HTTP. The figures must be
well formed (every request sent came back whole, percentiles ordered, counts that
add up), never fast: no speed is asserted. Plus the pure parts: sizes, text, arrivals."""

from __future__ import annotations

import json
import random
import socket
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from disagg.bench.load import (
    QUICK,
    SMALL,
    LoadSettings,
    arrivals,
    load_table,
    parse_sizes,
    run_load_bench,
    seeded_text,
)
from disagg.bench.loadpeers import attach_disagg
from disagg.errors import AgentError
from tests.agentpool import AgentPool, AgentSet
from tests.conftest import Cli
from tests.gateways import fleet_gateway

SERVERS = ("disagg", "mlx_lm")


@pytest.fixture(scope="module")
def report(
    default_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    smol_set: AgentSet,
    agent_pool: AgentPool,
) -> Iterator[dict[str, Any]]:
    # The bench measures a `disagg serve` process (over pooled agents) and starts
    # mlx_lm.server itself.
    d = tmp_path_factory.mktemp("load")
    with fleet_gateway(d, smol_set, default_model, agent_pool.token_file, ()) as (url, _):
        messages: list[str] = []
        r = run_load_bench(default_model, QUICK, log_dir=d, say=messages.append, url=url)
    assert messages and r["url"] == url
    yield r


def runs(server: dict[str, Any]) -> list[dict[str, Any]]:
    """Every summarized run of one server: warm-up, levels, the mixed run's parts."""
    mixed = server["mixed"]
    return [server["warmup"], *server["levels"], mixed["all"], mixed["short"], mixed["long"]]


@pytest.mark.slow
def test_every_request_sent_completes(report: dict[str, Any]) -> None:
    for key in SERVERS:
        server = report["servers"][key]
        assert "error" not in server, server.get("error")
        assert server["warmup"]["requests"] == server["warmup"]["completed"] == 1
        levels = server["levels"]
        assert [lv["concurrency"] for lv in levels] == list(QUICK.concurrency)
        for lv in levels:
            sent = QUICK.per_level(lv["concurrency"])
            assert lv["requests"] == lv["completed"] == len(lv["per_request"]) == sent
            assert lv["errors"] == []
            assert all(r["kind"] == "grader" and r["error"] is None for r in lv["per_request"])
        mixed = server["mixed"]
        assert mixed["all"]["requests"] == mixed["all"]["completed"] == QUICK.mixed_requests
        assert mixed["short"]["requests"] + mixed["long"]["requests"] == QUICK.mixed_requests
        assert mixed["short"]["requests"] >= 1 and mixed["long"]["requests"] >= 1


@pytest.mark.slow
def test_figures_are_well_formed(report: dict[str, Any]) -> None:
    for key in SERVERS:
        for run in runs(report["servers"][key]):
            assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
            assert 0 < run["tpot_p50_s"] <= run["tpot_p99_s"]
            assert 0 <= run["slot_wait_p50_s"] <= run["slot_wait_p99_s"]
            assert 0 < run["max_gap_s"] < run["wall_s"]
            # every request got between 2 and max_tokens tokens (no TPOT from fewer)
            tokens = run["completion_tokens"]
            assert 2 * run["completed"] <= tokens <= QUICK.new_tokens * run["completed"]
            assert run["tokens_per_s"] == pytest.approx(tokens / run["wall_s"])
        for lv in report["servers"][key]["levels"]:
            per = lv["per_request"]
            assert sum(r["tokens"] for r in per) == lv["completion_tokens"]
            assert max(r["max_gap_s"] for r in per) == pytest.approx(lv["max_gap_s"], abs=1e-3)
            ttft = [r["ttft_s"] for r in per]  # rounded to the millisecond
            assert min(ttft) - 1e-3 <= lv["ttft_p50_s"] <= lv["ttft_p99_s"] <= max(ttft) + 1e-3


@pytest.mark.slow
def test_grader_requests_share_the_rubric_on_both_servers(report: dict[str, Any]) -> None:
    # Both report prompt tokens served from their prompt cache (OpenAI's cached_tokens):
    # the rubric is the shared prefix, so every warm grader request hits it.
    rubric = report["rubric_tokens"]
    for key in SERVERS:
        for lv in report["servers"][key]["levels"]:
            assert lv["prompt_tokens_mean"] > rubric
            assert 0 < lv["cached_tokens_mean"] < lv["prompt_tokens_mean"]


@pytest.mark.slow
def test_report_is_json_and_renders(report: dict[str, Any]) -> None:
    json.dumps(report)
    console = Console(width=200, record=True)
    console.print(load_table(report))
    text = console.export_text()
    assert "mlx_lm.server" in text and "2 concurrent" in text and "mixed" in text


def test_sizes_presets_and_overrides() -> None:
    assert parse_sizes("issue") == LoadSettings()
    assert LoadSettings().rubric_tokens == 3000 and LoadSettings().concurrency == (1, 4, 16)
    assert parse_sizes("") == parse_sizes("small") == SMALL
    s = parse_sizes("issue, concurrency=2/8 ,rate=0.25,peer=off,requests=3")
    assert s.concurrency == (2, 8) and s.rate == 0.25 and s.peer is False
    assert s.rubric_tokens == 3000 and [s.per_level(c) for c in s.concurrency] == [6, 24]
    assert parse_sizes("quick,min_requests=5").per_level(1) == 5


@pytest.mark.parametrize(
    "spec, says",
    [
        ("huge", "unknown preset 'huge'"),
        ("colour=red", "unknown key 'colour'"),
        ("rubric=lots", "rubric='lots': expected a number"),
        ("concurrency=1-4", "expected like 1/4/16"),
        ("peer=yes", "expected on or off"),
        ("concurrency=0/4", "levels of at least 1"),
        ("rate=0", "rate > 0"),
    ],
)
def test_bad_sizes_name_the_problem(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sizes(spec)


def test_seeded_text_fits_its_token_count(default_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))

    def count(s: str) -> int:
        return len(tok.encode(s))

    for n in (20, 300):
        text = seeded_text(count, n, seed=3, head="Submission 1:")
        assert text.startswith("Submission 1:")
        assert n - 5 <= count(text) <= n  # one more word would pass n
        assert seeded_text(count, n, seed=3, head="Submission 1:") == text
    assert seeded_text(count, 50, seed=1) != seeded_text(count, 50, seed=2)


def test_arrivals_are_poisson_times() -> None:
    times = arrivals(4000, rate=2.0, rng=random.Random(0))
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)  # 1 / rate
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd = mean


def test_a_url_where_no_gateway_answers_is_one_line(cli: Cli, default_model: Path) -> None:
    bad = cli("bench", "load", "--url", "ftp://x", "-m", str(default_model))
    assert bad.returncode == 1 and "--url takes http://HOST:PORT" in bad.stderr
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed at once: nobody answers there
    with pytest.raises(AgentError, match=rf"^no disagg gateway answers at http://127.0.0.1:{port}"):
        attach_disagg(f"http://127.0.0.1:{port}/", default_model, wait_s=2)

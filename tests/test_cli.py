"""The `disagg` command: stdout, stderr, exit code. Two `--local` runs as a user
runs them, a process that starts and stops its own agents; the rest in this
process (typer's runner), their `--local` agents from the session's pool."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cli, DisaggProcess
from tests.tinymodels import shared_tiny


def one_error_line(proc: Any, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_generate_local_json_answers_paris(
    default_model: Path, disagg_process: DisaggProcess, tmp_path: Path
) -> None:
    # A stand-in for another top-level `agents` package (the OpenAI Agents SDK installs
    # one) first on the path of the CLI and its agents: our package has its own name.
    standin = tmp_path / "site" / "agents"
    (standin / "models").mkdir(parents=True)
    (standin / "__init__.py").write_text("from .models import Model\nclass Agent: ...\n")
    (standin / "models" / "__init__.py").write_text("class Model: ...\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)
    # A process that starts its own agents and stops them on the way out.
    proc = disagg_process(
        "generate", "--local", "What is the capital of France?", "--json", agents=1,
        env={"PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON object on stdout
    want = {"text", "reasoning", "tool_calls", "finish_reason", "token_ids", "model", "metrics"}
    assert set(out) == want
    assert "Paris" in out["text"]
    # SmolLM2's template has no reasoning and no tools: the answer is all there is.
    assert out["reasoning"] == "" and out["tool_calls"] == [] and out["finish_reason"] == "stop"
    assert out["model"] == str(default_model)
    m = out["metrics"]
    assert m["method"] == "disaggregated" and m["kv_bytes"] > 0
    assert m["completion_tokens"] == len(out["token_ids"])
    # The per-request timeline (disagg_agents.decode.timeline): seconds on the decode agent's clock.
    t = m["timeline"]
    assert abs(t["at"] - time.time()) < 600
    order = ["prefill_start", "kv_first", "kv_last", "first_token", "done"]
    assert [t[k] for k in order] == sorted(t[k] for k in order), t
    assert 0 <= t["prefill_start"] < t["prefill_end"] <= t["first_token"] + 1e-3
    assert t["done"] <= m["total_time"] and m["queue_time"] >= 0


def test_generate_local_streams_text_and_prints_metrics_table(cli_local: Cli) -> None:
    # Remote asked for: the pooled agents' placement has learned from earlier tests.
    proc = cli_local(
        "generate", "--local", "What is the capital of France?", "-n", "12", "--placement", "remote"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    for name in (
        "prefill_time",
        "ttft",
        "kv_bytes",
        "kv_transfer_time",
        "disaggregated",
        "prefill_server",
        "decode_server",
    ):
        assert name in proc.stderr  # the table: `> answer.txt` keeps the answer alone
    assert "prefill_time" not in proc.stdout


def test_prompt_longer_than_context_is_one_line(cli_local: Cli) -> None:
    proc = cli_local("generate", "--local", "--raw", "word " * 9000)
    one_error_line(proc, "context is 8192", "shorten the prompt")


def test_verify_reports_full_agreement(disagg_process: DisaggProcess) -> None:
    proc = disagg_process("verify", "--local", "--max-tokens", "16", "--json", agents=1)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["agreement"] == 1.0 and report["first_divergence"] is None
    assert report["ok"] is True and report["kv_bytes"] > 0
    assert report["max_logit_diff"] < 1e-3


def test_serve_on_a_busy_port_is_refused_before_any_agent(
    disagg_process: DisaggProcess, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:  # another server holds the port
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = disagg_process(
            "serve", "--local", "--port", str(port), timeout=60, env={"TMPDIR": str(tmp_path)}
        )
        took = time.monotonic() - t0
    print(f"busy port refused in {took:.2f} s")
    one_error_line(proc, f"port {port}", "in use", "--port")
    assert took < 2.0, took
    # No agent started: none wrote a log dir, and the model was not even looked up.
    assert not list(tmp_path.iterdir()) and "serving" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (["generate", "--local", ""], ["prompt is empty"]),
        (
            ["generate", "--local", "hi", "--max-tokens", "0"],
            ["max_tokens must be at least 1", "(--max-tokens)"],
        ),
        (
            ["generate", "--local", "hi", "--max-tokens", "-5"],
            ["max_tokens must be at least 1, got -5"],
        ),
        (
            ["generate", "--local", "hi", "-m", "/no/such/model"],
            ["/no/such/model", "does not exist"],
        ),
        (["generate", "hi"], ["inventory not found", "-i FILE", "--local"]),
        (["verify", "--local", "hi", "--min-agreement", "2"], ["--min-agreement"]),
        (["generate", "--local", "hi", "--kv-quant", "int4"], ["--kv-quant 'int4'", "int8"]),
    ],
)
def test_bad_input_is_one_clear_line(cli: Cli, args: list[str], needles: list[str]) -> None:
    one_error_line(cli(*args), *needles)


def test_unsupported_architecture_is_one_clear_line(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    one_error_line(
        cli("generate", "--local", "hi", "-m", str(tmp_path)), "'bert' is not supported", "llama"
    )
    (tmp_path / "config.json").write_text("{broken")
    one_error_line(cli("generate", "--local", "hi", "-m", str(tmp_path)), "cannot read")


@pytest.fixture(scope="module")
def two_tiny(tiny_model: Any) -> tuple[Path, Path]:
    return shared_tiny("qwen3_moe"), shared_tiny("gpt_oss")


def test_two_models_at_once(two_tiny: tuple[Path, Path], cli_local: Cli) -> None:
    moe, oss = two_tiny
    proc = cli_local(
        "generate", "--local", "-m", str(moe), "-m", str(oss), "--raw", "hello", "-n", "6", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["model"] for r in out["results"]] == [moe.name, oss.name]
    assert all(r["metrics"]["method"] in ("disaggregated", "local") for r in out["results"])
    assert all(len(r["token_ids"]) == r["metrics"]["completion_tokens"] > 0 for r in out["results"])
    assert out["failed"] == 0 and out["wall_time"] > 0


def test_batch_file_writes_jsonl_results(
    two_tiny: tuple[Path, Path], tmp_path: Path, cli_local: Cli
) -> None:
    moe, oss = two_tiny
    batch = tmp_path / "reqs.jsonl"
    lines = [
        {"model": moe.name, "prompt": "one", "raw": True, "max_tokens": 3},
        {"model": oss.name, "prompt": "two", "raw": True},
        {"model": moe.name, "prompt": "three", "raw": True},
    ]
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = cli_local(
        "generate", "--local", "-m", str(moe), "-m", str(oss), "--batch", str(batch), "-n", "5"
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 requests, 0 failed" in proc.stdout and "sum of request times" in proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "reqs.results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert [r["model"] for r in rows] == [moe.name, oss.name, moe.name]
    assert len(rows[0]["token_ids"]) == 3 and len(rows[1]["token_ids"]) <= 5

    # A request the model cannot serve is an error row; the others still complete.
    batch.write_text(
        json.dumps({"model": moe.name, "messages": [{"role": "user", "content": "x"}]})
        + "\n"
        + json.dumps(lines[0])
        + "\n"
    )
    proc = cli_local("generate", "--local", "-m", str(moe), "--batch", str(batch), "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["failed"] == 1 and "has no chat template" in out["results"][0]["error"]
    assert len(out["results"][1]["token_ids"]) == 3


def test_bad_batch_file_is_one_line(cli: Cli, tmp_path: Path) -> None:
    batch = tmp_path / "bad.jsonl"
    batch.write_text('{"prompt": "fine"}\n{oops\n')
    one_error_line(
        cli("generate", "--local", "--batch", str(batch)),
        "bad.jsonl:2",
        "not valid JSON",
    )

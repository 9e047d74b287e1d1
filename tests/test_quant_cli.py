"""Quantized checkpoints through the `disagg` command (in this process, its `--local`
agents from the session's pool): a 4-bit dir answers, other weights on the prefill
side are refused or labelled, and a format neither side runs is one line before
any agent starts."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.conftest import Cli
from tests.quantmodels import DIRS, quant_dir
from tests.test_cli import one_error_line

PROMPT = "What is the capital of France?"
# verify's decode-only run has the decode agent prefill the prompt on mlx-lm's 4-bit
# matmuls (~0.1 s a token on a Linux CPU): 6 raw tokens, not the chat template's 37 (its
# system prompt); a prompt to continue, as after the raw question the full-precision
# model ends at once, leaving no log-probs to compare.
RAW_PROMPT = "The capital of France is"


@pytest.mark.parametrize("name", DIRS)
def test_generate_local_runs_on_a_quantized_dir(cli_local: Cli, name: str) -> None:
    model = str(quant_dir(name))
    # Remote asked for: the pooled agents' placement has learned from earlier tests.
    proc = cli_local(
        "generate", "--local", "-m", model, "-n", "6", "--json", "--placement", "remote", PROMPT
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["metrics"]["method"] == "disaggregated" and out["metrics"]["weights"] == "same"
    assert len(out["token_ids"]) > 0 and out["text"].strip()


def test_mixed_weights_on_the_command_line(default_model: Path, cli_local: Cli) -> None:
    q4 = str(quant_dir("smol-affine4"))
    refused = cli_local(
        "generate", "--local", "-m", q4, "--prefill-model", str(default_model), "-n", "4", PROMPT
    )
    one_error_line(refused, "full precision", "4-bit", "--allow-mixed")
    allowed = cli_local(
        "verify", "--local", "-m", q4, "--prefill-model", str(default_model),
        "--allow-mixed", "-n", "6", "--min-agreement", "0", "--json", "--raw", RAW_PROMPT,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    report = json.loads(allowed.stdout)
    assert report["weights"] == "mixed" and report["compared"] > 0
    # The prefill really ran the other weights: the log-probs are the full-precision
    # model's, not the 4-bit one's. 4-bit noise moves SmolLM2's log-probs by far more than
    # 1e-2; torch-vs-mlx float32 rounding on the same weights stays near 1e-4.
    assert report["max_logit_diff"] > 1e-2, report


def test_unsupported_format_is_one_line_and_starts_no_agent(
    default_model: Path, tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "gptq"
    model.mkdir()
    cfg = json.loads((default_model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "model.safetensors").write_bytes(b"")
    # Every local agent start makes a `disagg-logs-*` dir under TMPDIR: none may appear.
    # (`cli` also fails the run if anything asks for agents.)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # TMPDIR, as this process reads it
    proc = cli("generate", "--local", "-m", str(model), "hi")
    one_error_line(proc, "GPTQ", "not supported", "mlx_lm.convert")
    assert list(tmp.glob("disagg-logs-*")) == []  # refused before any agent process


def test_a_gguf_file_is_refused_in_one_line(tmp_path: Path, cli: Cli) -> None:
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    proc = cli("generate", "--local", "-m", str(gguf), "hi")
    one_error_line(proc, "GGUF", "mlx_lm.convert")

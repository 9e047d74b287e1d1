"""Real agent processes on tiny seeded random checkpoints of the MoE and
sliding-window architectures, and what happens when two agents disagree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from disagg import client
from disagg.errors import ModelMismatch
from disagg.launcher import AgentProc, make_token_file, start_local_pair
from tests.tinymodels import PROMPT, make_tiny

from .references import hf_greedy, mlx_greedy

pytestmark = pytest.mark.slow

N_NEW = 64
WINDOW = 8


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Path, AgentProc, AgentProc]]]:
    root = tmp_path_factory.mktemp("tiny-agents")
    out: dict[str, tuple[Path, AgentProc, AgentProc]] = {}
    token_file, _ = make_token_file(root)  # one cluster: the mismatch test crosses pairs
    try:
        for arch in ("gpt_oss", "qwen3_moe"):
            extra = {"sliding_window": WINDOW} if arch == "gpt_oss" else {}
            path = make_tiny(arch, root / arch, seed=1, **extra)
            pair = start_local_pair(path, log_dir=root / f"logs-{arch}", token_file=token_file)
            out[arch] = (path, *pair)
        yield out
    finally:
        for _, prefill, decode in out.values():
            decode.stop()
            prefill.stop()


def long_prompt() -> str:
    return " ".join([PROMPT] * 6)


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_tiny_agents_match_both_monolithic_references(
    tiny: dict[str, tuple[Path, AgentProc, AgentProc]], arch: str
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from agents.decode import DecodeEngine

    path, prefill, decode = tiny[arch]
    req: dict[str, Any] = {
        "prompt": long_prompt(),
        "raw": True,
        "max_tokens": N_NEW,
        "ignore_eos": True,
        "return_prompt_ids": True,
        "placement": "remote",
        "prefill": {"host": prefill.host, "port": prefill.port},
    }
    res = client.generate(decode.host, decode.port, req, token=decode.token)
    ids = res.prompt_ids or []
    assert res.metrics["method"] == "disaggregated" and res.metrics["kv_bytes"] > 0
    if arch == "gpt_oss":
        assert len(ids) >= 4 * WINDOW
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert res.token_ids == hf_greedy(hf, ids, N_NEW)
    assert res.token_ids == mlx_greedy(DecodeEngine(str(path)).model, ids, N_NEW)


def test_mismatched_models_fail_naming_both(
    tiny: dict[str, tuple[Path, AgentProc, AgentProc]],
) -> None:
    gpt_dir, _, gpt_decode = tiny["gpt_oss"]
    moe_dir, moe_prefill, _ = tiny["qwen3_moe"]
    texts: list[str] = []
    req = {
        "prompt": PROMPT,
        "raw": True,
        "max_tokens": 8,
        "placement": "remote",
        "prefill": {"host": moe_prefill.host, "port": moe_prefill.port},
    }
    with pytest.raises(ModelMismatch) as info:
        client.generate(
            gpt_decode.host, gpt_decode.port, req, on_text=texts.append, token=gpt_decode.token
        )
    message = str(info.value)
    assert str(gpt_dir) in message and str(moe_dir) in message
    assert "architecture qwen3_moe vs gpt_oss" in message
    assert texts == []
    # Both agents keep serving their own pipelines.
    for arch in ("gpt_oss", "qwen3_moe"):
        _, prefill, decode = tiny[arch]
        ok = client.generate(
            decode.host,
            decode.port,
            {**req, "prefill": {"host": prefill.host, "port": prefill.port}},
            token=decode.token,
        )
        assert ok.metrics["method"] == "disaggregated" and ok.metrics["completion_tokens"] > 0

"""The core handoff on the embedded SmolLM2, through real agent processes:
torch prefill agent -> KV frames over TCP -> mlx decode agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disagg.errors import UsageError
from disagg.serving import wireclient as client
from disagg.serving.localagents import AgentProc
from disagg.serving.metrics import SEED_NAMES
from tests.conftest import ask

from .references import hf_greedy, mlx_greedy

pytestmark = pytest.mark.slow

N_NEW = 64
LONG = (
    "Here is a list.\n"
    + "\n".join(
        f"Entry {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7 % 31} stones."
        for i in range(90)
    )
    + "\nWhich box holds the most stones?"
)


@pytest.fixture(scope="module")
def hf_model(default_model: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mlx_model(default_model: Path) -> Any:
    from mlx_lm import load

    return load(str(default_model))[0]


def run(
    agents: tuple[AgentProc, AgentProc], prompt: str, *, remote: bool = True, **extra: Any
) -> client.Result:
    prefill, decode = agents
    req: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": N_NEW,
        "ignore_eos": True,
        "return_prompt_ids": True,
        "placement": "remote",
        **extra,
    }
    if remote:
        req["prefill"] = {"host": prefill.host, "port": prefill.port}
    return ask(decode, req)


@pytest.fixture(scope="module")
def long_run(smol_agents: tuple[AgentProc, AgentProc]) -> client.Result:
    return run(smol_agents, LONG)


@pytest.mark.parametrize(
    "prompt, raw",
    [
        ("What is the capital of France?", False),
        ("Write a short poem about the sea.", False),
        ("The three primary colors are", True),
    ],
)
def test_greedy_parity_short(
    smol_agents: tuple[AgentProc, AgentProc], hf_model: Any, mlx_model: Any, prompt: str, raw: bool
) -> None:
    res = run(smol_agents, prompt, raw=raw)
    assert res.metrics["method"] == "disaggregated"
    assert res.prompt_ids and res.metrics["kv_bytes"] > 0
    assert len(res.token_ids) == N_NEW
    assert res.token_ids == hf_greedy(hf_model, res.prompt_ids, N_NEW)
    assert res.token_ids == mlx_greedy(mlx_model, res.prompt_ids, N_NEW)


def test_greedy_parity_long_prompt(long_run: client.Result, hf_model: Any, mlx_model: Any) -> None:
    assert long_run.prompt_ids is not None and len(long_run.prompt_ids) > 1000
    assert long_run.metrics["method"] == "disaggregated"
    assert long_run.token_ids == hf_greedy(hf_model, long_run.prompt_ids, N_NEW)
    assert long_run.token_ids == mlx_greedy(mlx_model, long_run.prompt_ids, N_NEW)


def test_layers_stream_while_prefill_computes(long_run: client.Result) -> None:
    m = long_run.metrics
    # Both agents run on this host, so their wall clocks are the same clock.
    assert m["kv_first_layer_at"] < m["prefill_last_layer_at"], (
        "decode side got layer 0 only after prefill finished the last layer"
    )
    # 30 layers x 2 (K, V) x 3 heads x 64 dims x 4 bytes per prompt token not already
    # held by the decode side's prefix cache (the chat template's first block may be).
    kv_payload = 30 * 2 * 3 * 64 * 4 * (m["prompt_tokens"] - m["cached_tokens"])
    assert kv_payload < m["kv_bytes"] < kv_payload + 30 * 100


def test_metrics_have_the_seed_names(smol_agents: tuple[AgentProc, AgentProc]) -> None:
    res = run(smol_agents, "Say hello.", max_tokens=4)
    m = res.metrics
    for name in SEED_NAMES:
        assert m[name] is not None, name
    assert m["prefill_server"] == "prefill@127.0.0.1" and m["decode_server"] == "decode@127.0.0.1"
    assert m["completion_tokens"] == 4 and m["prompt_tokens"] == len(res.prompt_ids or [])
    assert 0 < m["ttft"] <= m["total_time"]


@pytest.mark.parametrize(
    "request_, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens must be at least 1"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "word " * 9000, "raw": True}, "context is 8192"),
    ],
)
def test_bad_requests_leave_the_agent_healthy(
    smol_agents: tuple[AgentProc, AgentProc], request_: dict[str, Any], message: str
) -> None:
    prefill, decode = smol_agents
    seen: list[str] = []
    with pytest.raises(UsageError, match=message):
        ask(
            decode,
            {**request_, "prefill": {"host": prefill.host, "port": prefill.port}},
            on_text=seen.append,
        )
    assert seen == []
    ok = run(smol_agents, "What is the capital of France?", max_tokens=8, ignore_eos=False)
    assert "Paris" in ok.text and ok.metrics["method"] == "disaggregated"
    assert prefill.alive() and decode.alive()


def test_prefill_agent_down_falls_back_locally(smol_agents: tuple[AgentProc, AgentProc]) -> None:
    _, decode = smol_agents
    req = {
        "prompt": "What is the capital of France?",
        "max_tokens": 8,
        "prefill": {"host": "127.0.0.1", "port": 1},
    }
    res = ask(decode, req)
    assert res.metrics["method"] == "local-fallback"
    assert "cannot reach prefill agent" in res.metrics["fallback_reason"]
    assert res.metrics["fallback_kind"] == "unreachable"
    assert "Paris" in res.text


def test_auto_placement_follows_its_own_estimates(
    smol_agents: tuple[AgentProc, AgentProc],
) -> None:
    # By now this decode agent has measured the prefill agent (the runs above) and
    # its own prefill (the fallback above); it must pick whichever it estimates faster.
    import re

    prefill, decode = smol_agents
    req = {
        "prompt": "What is the capital of France?",
        "max_tokens": 4,
        "prefill": {"host": prefill.host, "port": prefill.port},
    }
    m = ask(decode, req).metrics
    found = re.search(
        r"est\. remote ([\d.]+) ms .* vs local ([\d.]+) ms \(local prefill", m["placement_reason"]
    )
    assert found, m["placement_reason"]
    remote_ms, local_ms = float(found[1]), float(found[2])
    assert m["placement"] == ("local" if local_ms < remote_ms else "remote")
    assert m["method"] == ("local" if m["placement"] == "local" else "disaggregated")


def _get(agent: AgentProc, path: str) -> str:
    return agent.control(path).decode()


def test_control_endpoints_report_what_happened(smol_agents: tuple[AgentProc, AgentProc]) -> None:
    import json

    prefill, decode = smol_agents
    assert json.loads(_get(decode, "/health")) == {"ok": True, "draining": False}
    status = json.loads(_get(decode, "/status"))
    assert status["role"] == "decode" and status["backend"] == "mlx" and status["loaded"]
    assert status["requests"] > 5 and status["errors"] >= 6  # the bad requests above
    assert 0 < status["ttft_p50_s"] <= status["ttft_p95_s"] <= status["ttft_p99_s"]
    text = _get(decode, "/metrics")
    ok = [
        ln
        for ln in text.splitlines()
        if ln.startswith('disagg_requests_total{role="decode",method="disaggregated",outcome="ok"}')
    ]
    assert ok and int(ok[0].split()[-1]) > 5
    assert 'outcome="bad_request"' in text and 'method="local-fallback"' in text
    for name in ("ttft_seconds", "tpot_seconds", "kv_transfer_seconds"):
        count = [ln for ln in text.splitlines() if ln.startswith(f"disagg_{name}_count")]
        assert count and int(count[0].split()[-1]) > 0, name
    for name in ("queue_seconds", "kv_request_bytes"):
        count = [ln for ln in text.splitlines() if ln.startswith(f"disagg_{name}_count")]
        assert count and int(count[0].split()[-1]) > 0, name
    assert 'disagg_fallbacks_total{role="decode",reason="unreachable"}' in text
    kv = [ln for ln in text.splitlines() if ln.startswith("disagg_kv_bytes_total")]
    assert int(kv[0].split()[-1]) > 1_000_000
    ptext = _get(prefill, "/metrics")
    assert 'disagg_requests_total{role="prefill",method="prefill",outcome="ok"}' in ptext
    assert json.loads(_get(prefill, "/status"))["backend"] == "torch"
    count = [ln for ln in ptext.splitlines() if ln.startswith("disagg_prefill_seconds_count")]
    assert int(count[0].split()[-1]) > 5

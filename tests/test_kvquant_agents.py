"""kv_quant "int8" through real agent processes (SmolLM2): the decode agent asks for it,
the prefill agent sends int8 K/V over the socket between them, the first token is the
prefill's own, and lossy K/V never enters the decode agent's prefix cache."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.errors import UsageError
from disagg.serving.localagents import AgentProc
from tests.conftest import ask

pytestmark = pytest.mark.slow

# SmolLM2-135M K and V rows: 64 float32 dims (256 bytes) -> 64 int8 + a 4-byte scale.
INT8_SHRINK = 256 / 68


def req(agents: tuple[AgentProc, AgentProc], prompt: str, **extra: Any) -> dict[str, Any]:
    prefill, _ = agents
    return {
        "prompt": prompt,
        "raw": True,
        "max_tokens": 6,
        "ignore_eos": True,
        "placement": "remote",
        "prefill": {"host": prefill.host, "port": prefill.port},
        **extra,
    }


def test_int8_kv_crosses_between_agent_processes(
    smol_agents: tuple[AgentProc, AgentProc],
) -> None:
    _, decode = smol_agents
    prompt = "The int8 test: a list of colours, one per line, starting with red,"
    lossless = ask(decode, req(smol_agents, prompt, prefix_cache=False))
    int8 = ask(decode, req(smol_agents, prompt, prefix_cache=False, kv_quant="int8"))
    for r, quant in ((lossless, None), (int8, "int8")):
        assert (r.metrics.method, r.metrics.kv_quant) == ("disaggregated", quant)
        assert r.metrics.cached_tokens == 0 and len(r.token_ids) == 6
    # The same rows crossed, each at 68 bytes instead of 256.
    shrink = (lossless.metrics.kv_payload_bytes or 0) / (int8.metrics.kv_payload_bytes or 0)
    assert shrink == pytest.approx(INT8_SHRINK)
    assert (int8.metrics.kv_quant_time or 0) > 0
    # Token 0 comes from the prefill's last-position logits, which no K/V quantizer touches.
    assert int8.token_ids[0] == lossless.token_ids[0]


def test_int8_kv_never_enters_the_prefix_cache(smol_agents: tuple[AgentProc, AgentProc]) -> None:
    _, decode = smol_agents
    # Long enough for several prefix-cache blocks; its own words, so no other test warmed it.
    prompt = " ".join(f"Lossy block {i} holds {i * 13 % 17} pebbles." for i in range(40))
    # Only the cache's hits are asked about: one decoded token each (not six).
    first = ask(decode, req(smol_agents, prompt, kv_quant="int8", max_tokens=1))
    again = ask(decode, req(smol_agents, prompt, kv_quant="int8", max_tokens=1))
    plain = ask(decode, req(smol_agents, prompt, max_tokens=1))
    assert [r.metrics.cached_tokens for r in (first, again, plain)] == [0, 0, 0]
    # The precondition: the same prompt lossless IS reused, so zero above is the rule at work.
    reused = ask(decode, req(smol_agents, prompt, max_tokens=1))
    assert (reused.metrics.cached_tokens or 0) > 0, reused.metrics


def test_unknown_kv_quant_is_refused_by_the_decode_agent(
    smol_agents: tuple[AgentProc, AgentProc],
) -> None:
    _, decode = smol_agents
    with pytest.raises(UsageError, match="'int8'"):
        ask(decode, req(smol_agents, "Hi", kv_quant="fp8"))

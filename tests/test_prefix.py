"""Prefix reuse with real agents: a prompt that starts like an earlier one reuses
that K/V on both sides, only the suffix's K/V crosses the wire, and greedy
output is token for token what the same request gives with the cache off."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from disagg.serving.localagents import AgentProc, wait_ready
from disagg.serving.wireclient import Result
from disagg_agents.prefix.store import BLOCK_TOKENS as BLOCK
from tests.agenthelpers import shared_len
from tests.conftest import PairFactory, Spawn, ask
from tests.gateways import Gateway, GatewaySpec
from tests.tinymodels import PROMPT, shared_tiny

pytestmark = pytest.mark.slow

N_NEW = 8  # a wrong cached block shows in the first tokens
WINDOW = 8
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def base(**kw: Any) -> dict[str, Any]:
    req = {
        "raw": True,
        "max_tokens": N_NEW,
        "ignore_eos": True,
        "return_prompt_ids": True,
        "placement": "remote",  # auto may choose a local prefill on a fast box
    }
    return {**req, **kw}


def expected_hit(first: list[int], second: list[int], window: int = 0) -> int:
    cap = len(second) - 1 if not window else len(second) - window
    return min(shared_len(first, second), cap) // BLOCK * BLOCK


def status(agent: AgentProc) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(agent.control("/status"))
    return out


def token_bytes(fp: dict[str, Any]) -> int:
    """K + V bytes of one position of one layer."""
    return 2 * fp["num_kv_heads"] * fp["head_dim"] * ITEMSIZE[fp["dtype"]]


def check_hit(
    decode: AgentProc, prefill: AgentProc, first_text: str, second_text: str, *, window: int = 0
) -> tuple[Result, Result]:
    """Cache off for the second prompt, then the first, then the second: a hit
    with only the suffix on the wire and the same tokens. Returns (off, hit). The first
    only fills the caches (its prompt's ids are all that is read of it): one token."""
    off = ask(decode, base(prompt=second_text, prefix_cache=False), prefill=prefill)
    first = ask(decode, base(prompt=first_text, max_tokens=1), prefill=prefill)
    hit = ask(decode, base(prompt=second_text), prefill=prefill)
    assert off.metrics.method == hit.metrics.method == "disaggregated"
    assert off.metrics.cached_tokens == 0
    n = expected_hit(first.prompt_ids or [], hit.prompt_ids or [], window)
    assert n > 0
    assert hit.metrics.cached_tokens == n
    assert hit.token_ids == off.token_ids
    fp = status(decode)["fingerprint"]
    full = sum(1 for kind, _ in fp["layers"] if kind == "full")
    # Only the suffix's positions of the full-attention layers are not sent again;
    # sliding layers send their last window-1 positions either way.
    saved = (off.metrics.kv_raw_bytes or 0) - (hit.metrics.kv_raw_bytes or 0)
    assert saved == full * n * token_bytes(fp)
    assert (hit.metrics.kv_bytes or 0) < (off.metrics.kv_bytes or 0)
    # The prefill agent computed only the suffix, sliding layers included (it
    # keeps their every position): its own hit is not capped by the window.
    assert hit.metrics.prefill_cached_tokens == expected_hit(
        first.prompt_ids or [], hit.prompt_ids or []
    )
    return off, hit


def long_text(tag: str, times: int = 6) -> str:
    return f"{tag}: " + " ".join([PROMPT] * times)


def test_smollm2_second_request_hits_and_matches(
    smol_agents: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = smol_agents
    shared = long_text("Grade this answer against the rubric", 4)
    off, hit = check_hit(
        decode, prefill, shared + " Answer one: Paris.", shared + " Answer two: Rome is it."
    )
    s = status(decode)["prefix_cache"]
    assert s["hits"] >= 1 and s["bytes"] > 0
    assert "disagg_prefix_cache_hits_total" in decode.control("/metrics").decode()
    assert status(prefill)["prefix_cache"]["hits"] >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_tiny_archs_hit_and_match(agent_pair: PairFactory, arch: str) -> None:
    prefill, decode = agent_pair(shared_tiny(arch))  # gpt_oss: sliding window WINDOW
    shared = long_text(arch)
    window = WINDOW if arch == "gpt_oss" else 0
    off, _ = check_hit(
        decode, prefill, shared + " The end.", shared + " Then the cache said hello.", window=window
    )
    if window:
        assert len(off.prompt_ids or []) >= 4 * WINDOW


def test_local_prefill_hits_and_matches(smol_agents: tuple[AgentProc, AgentProc]) -> None:
    _, decode = smol_agents
    shared = long_text("Local", 4)
    off = ask(decode, base(prompt=shared + " B side.", prefix_cache=False, placement="local"))
    ask(decode, base(prompt=shared + " A side.", placement="local", max_tokens=1))  # fills
    hit = ask(decode, base(prompt=shared + " B side.", placement="local"))
    assert (hit.metrics.cached_tokens or 0) > 0
    assert hit.token_ids == off.token_ids


def test_concurrent_requests_sharing_a_prefix(smol_agents: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = smol_agents
    shared = long_text("Concurrent", 4)
    texts = [f"{shared} Student {i} wrote {i * 7} lines." for i in range(4)]
    n = 8  # a wrong cached block shows in the first tokens; eight requests of SmolLM2

    def each(**kw: Any) -> list[Result]:
        """The four texts at once (batch rows, as the hits below run)."""
        with ThreadPoolExecutor(4) as pool:
            return list(
                pool.map(
                    lambda t: ask(decode, base(prompt=t, max_tokens=n, **kw), prefill=prefill),
                    texts,
                )
            )

    offs = each(prefix_cache=False)
    assert all(r.metrics.cached_tokens == 0 for r in offs)
    # Only fills the cache with the shared prefix: one token of output does that.
    ask(decode, base(prompt=shared + " warm up.", max_tokens=1), prefill=prefill)
    ons = each()
    assert [r.token_ids for r in ons] == [r.token_ids for r in offs]
    assert all((r.metrics.cached_tokens or 0) > 0 for r in ons)


def test_eviction_at_a_tiny_cache_never_fails(agent_pair: PairFactory) -> None:
    # About 3 blocks of this model's K/V: every new prompt evicts older blocks.
    prefill, decode = agent_pair(
        "llama",
        seed=3,
        prefill_args=["--prefix-cache-mb", "0.05"],
        decode_args=["--prefix-cache-mb", "0.05"],
    )
    for i in range(6):
        text = long_text(f"Evict {i % 3}")
        off = ask(decode, base(prompt=text + " x", prefix_cache=False), prefill=prefill)
        on = ask(decode, base(prompt=text + " x"), prefill=prefill)
        assert on.token_ids == off.token_ids
    s = status(decode)["prefix_cache"]
    assert s["evictions"] > 0 and s["bytes"] <= s["max_bytes"]


def test_restarted_prefill_agent_answers_identically(
    fresh_agents: PairFactory, spawn: Spawn, tmp_path: Path
) -> None:
    prefill, decode = fresh_agents(shared_tiny("qwen3"))
    token_file = tmp_path / "token"  # the restarted agent's: its cluster's token
    token_file.write_bytes(prefill.token or b"")
    token_file.chmod(0o600)
    shared = long_text("Restart")
    off = ask(decode, base(prompt=shared + " two", prefix_cache=False), prefill=prefill)
    ask(decode, base(prompt=shared + " one"), prefill=prefill)
    model = Path(status(prefill)["model"])
    port = prefill.port
    prefill.proc.kill()  # gone with its cache, as a crash leaves it (no drain to wait out)
    prefill.stop()  # reaps it
    proc, log, name = spawn(
        "prefill",
        model,
        name=prefill.name,
        extra_args=["--token-file", str(token_file), "--port", str(port)],
    )
    again = wait_ready("prefill", proc, log, name, 120)
    again.token = prefill.token
    hit = ask(decode, base(prompt=shared + " two"), prefill=again)
    assert hit.metrics.method == "disaggregated", hit.metrics
    assert (hit.metrics.cached_tokens or 0) > 0
    assert hit.metrics.prefill_cached_tokens == 0  # its cache went with it
    assert hit.token_ids == off.token_ids


GATEWAY = GatewaySpec()  # as `disagg serve --local`, one decode agent


def test_chat_of_three_turns_through_the_gateway_hits(gateway: Gateway) -> None:
    import openai

    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = oai.models.list().data[0].id
    messages: list[Any] = [
        {"role": "system", "content": "You grade answers. " + " ".join([PROMPT] * 3)},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    cached: list[int] = []
    for turn in range(3):
        # Four tokens: each turn still adds over a block (reply, template, question).
        r = oai.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=4
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": f"And question {turn + 2}: the capital of Italy?"},
        ]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]

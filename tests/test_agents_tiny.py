"""Real agent processes on tiny seeded random checkpoints of the MoE and
sliding-window architectures, and what happens when two agents disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ModelMismatch
from disagg.serving.localagents import AgentProc
from tests.conftest import PairFactory, ask, remote_request
from tests.tinymodels import PROMPT, shared_tiny

from .references import TIE, hf_greedy, mlx_greedy, near_tie_misses

pytestmark = pytest.mark.slow

N_NEW = 64
WINDOW = 8


@pytest.fixture(scope="module")
def tiny(agent_pair: PairFactory) -> dict[str, tuple[Path, AgentProc, AgentProc]]:
    # Pooled sets are one cluster (one token): the mismatch test crosses pairs.
    out: dict[str, tuple[Path, AgentProc, AgentProc]] = {}
    for arch in ("gpt_oss", "qwen3_moe"):
        path = shared_tiny(arch)  # gpt_oss: sliding window WINDOW
        out[arch] = (path, *agent_pair(path))
    return out


def long_prompt() -> str:
    return " ".join([PROMPT] * 6)


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_tiny_agents_match_both_monolithic_references(
    tiny: dict[str, tuple[Path, AgentProc, AgentProc]], refs: Any, arch: str
) -> None:
    path, prefill, decode = tiny[arch]
    req = remote_request(prefill, long_prompt(), N_NEW, return_prompt_ids=True)
    res = ask(decode, req)
    ids = res.prompt_ids or []
    assert res.metrics.method == "disaggregated" and (res.metrics.kv_bytes or 0) > 0
    if arch == "gpt_oss":
        assert len(ids) >= 4 * WINDOW
    assert res.token_ids == hf_greedy(refs.hf(path), ids, N_NEW)
    assert res.token_ids == mlx_greedy(refs.mlx_own(path), ids, N_NEW)  # mlx-lm's own model


def test_mismatched_models_fail_naming_both(
    tiny: dict[str, tuple[Path, AgentProc, AgentProc]],
) -> None:
    gpt_dir, _, gpt_decode = tiny["gpt_oss"]
    moe_dir, moe_prefill, _ = tiny["qwen3_moe"]
    texts: list[str] = []
    req = remote_request(moe_prefill, ignore_eos=False)
    with pytest.raises(ModelMismatch) as info:
        ask(gpt_decode, req, on_text=texts.append)
    message = str(info.value)
    assert str(gpt_dir) in message and str(moe_dir) in message
    assert "architecture qwen3_moe vs gpt_oss" in message
    assert texts == []
    # Both agents keep serving their own pipelines.
    for arch in ("gpt_oss", "qwen3_moe"):
        _, prefill, decode = tiny[arch]
        ok = ask(decode, {**req, "prefill": {"host": prefill.host, "port": prefill.port}})
        assert ok.metrics.method == "disaggregated" and (ok.metrics.completion_tokens or 0) > 0


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_concurrent_requests_decode_in_one_batch_and_match_mlx_alone(
    tiny: dict[str, tuple[Path, AgentProc, AgentProc]], refs: Any, arch: str
) -> None:
    """Six requests of different lengths at once: they share decode steps (left-padded
    batch caches, sliding windows included) and each still gets what mlx-lm's own
    generation gives that prompt alone; one that ends early leaves the batch."""
    import json
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    path, prefill, decode = tiny[arch]
    words = PROMPT.split()
    prompts = [" ".join(words[: 3 + 4 * i] * (1 + i)) for i in range(6)]
    lengths = [N_NEW, 5, N_NEW, 17, N_NEW, 40]

    def run(i: int) -> Any:
        req = {
            "prompt": prompts[i],
            "raw": True,
            "max_tokens": lengths[i],
            "ignore_eos": True,
            "return_prompt_ids": True,
            # Half prefilled by the prefill agent, half here: both join the same batch.
            "placement": "remote" if i % 2 == 0 else "local",
            "prefill": {"host": prefill.host, "port": prefill.port},
        }
        return ask(decode, req)

    def status() -> dict[str, Any]:
        return json.loads(decode.control("/status"))

    def one_round() -> tuple[list[Any], int, int]:
        """The six at once; the largest batch seen meanwhile, and the steps taken."""
        seen, stop = [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen[0] = max(seen[0], status()["batch"])
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        steps_before = status()["decode_steps"]
        watcher.start()
        try:
            with ThreadPoolExecutor(6) as pool:
                results = list(pool.map(run, range(6)))
        finally:
            stop.set()
            watcher.join()
        return results, seen[0], status()["decode_steps"] - steps_before

    # The precondition, proven for the round whose tokens are checked: on a loaded
    # machine the prefills can be slow enough that the rows barely overlap.
    for _ in range(4):
        results, peak, steps = one_round()
        if peak >= 3:
            break
    assert peak >= 3, "in four rounds, never three of the six in one batch"
    assert status()["batch"] == 0
    # Shared steps: fewer steps than rows decoded (alone, each token after the first is a step).
    rows = sum(n - 1 for n in lengths)
    assert steps < rows
    # Against mlx-lm's own model alone: token-identical, or (the one named cause) a
    # batched float sum flipped a near-tie, every such token within TIE of the top.
    model = refs.mlx_own(path)
    same = 0
    for res, n in zip(results, lengths, strict=True):
        assert len(res.token_ids) == n
        ids = res.prompt_ids or []
        if res.token_ids == mlx_greedy(model, ids, n):
            same += 1
            continue
        misses = near_tie_misses(model, ids, res.token_ids)
        assert misses and all(gap <= TIE for _, gap in misses), misses
    print(f"{arch}: {same}/6 rows token-identical to mlx-lm alone, the rest near-ties")

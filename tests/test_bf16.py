"""bf16 end to end: the KV the decode agent decodes from is, bit for bit, the
bf16 KV torch computed; so its tokens equal mlx continuing from that KV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from disagg.serving.localagents import AgentProc
from disagg_agents.wire.kvcodec import DType, LayerKV, decode_layer, encode_layer
from tests.conftest import SMOL_BF16, PairFactory, ask, remote_request

from .references import mlx_greedy

pytestmark = pytest.mark.slow

N_NEW = 24


@pytest.fixture(scope="module")
def bf16_agents(default_model: Path, agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(default_model, **SMOL_BF16)


def test_bf16_run_equals_mlx_continued_from_the_same_kv(
    bf16_agents: tuple[AgentProc, AgentProc], default_model: Path
) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from disagg_agents.decode.agent import DecodeEngine
    from disagg_agents.decode.kvcaches import fill_layer
    from disagg_agents.prefill.engine import PrefillEngine

    prefill, decode = bf16_agents
    req = remote_request(
        prefill, "Name three planets of the solar system.", N_NEW, raw=False, return_prompt_ids=True
    )
    res = ask(decode, req)
    assert res.metrics["method"] == "disaggregated"
    ids = res.prompt_ids or []
    # bf16 on the wire: 2 bytes per element, 30 layers x K and V x 3 heads x 64 dims.
    assert res.metrics["kv_bytes"] >= 30 * 2 * 3 * 64 * 2 * len(ids)

    pre = PrefillEngine(str(default_model), device="cpu", dtype="bfloat16")
    dec = DecodeEngine(str(default_model), dtype="bfloat16")
    layers: list[LayerKV] = []
    _, logits = pre.prefill(ids, layers.append)
    assert {kv.dtype for kv in layers} == {DType.BFLOAT16}
    cache = make_prompt_cache(dec.model)
    for kv in layers:
        wire = decode_layer(b"".join(bytes(b) for b in encode_layer(kv)))
        fill_layer(cache[kv.layer], wire, len(ids))
    # mlx continues from the same bf16 KV, after the first token torch's logits chose.
    first = int(np.argmax(logits))
    assert res.token_ids == [first, *mlx_greedy(dec.model, [first], N_NEW - 1, cache=cache)]

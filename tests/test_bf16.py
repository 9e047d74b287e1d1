"""bf16 end to end: the KV the decode agent decodes from is, bit for bit, the
bf16 KV torch computed; so its tokens equal mlx continuing from that KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from disagg.serving.localagents import AgentProc
from tests.conftest import SMOL_BF16, PairFactory, ask, remote_request

from .references import mlx_greedy

pytestmark = pytest.mark.slow

# Eight tokens: a K/V that differs by one bit shows in the first few; each token past
# them cost a bf16 step of the agent and of mlx-lm's reference alike.
N_NEW = 8


@pytest.fixture(scope="module")
def bf16_agents(default_model: Path, agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(default_model, **SMOL_BF16)


def _to_mlx(t: Any) -> Any:
    """A torch bf16 tensor as an mlx bf16 array, bit for bit (numpy has no bfloat16:
    the raw 16-bit words travel)."""
    import mlx.core as mx
    import torch

    return mx.array(t.contiguous().view(torch.int16).numpy().view(np.uint16)).view(mx.bfloat16)


def test_bf16_run_equals_mlx_continued_from_the_same_kv(
    bf16_agents: tuple[AgentProc, AgentProc], default_model: Path
) -> None:
    """The references are transformers' and mlx-lm's own: transformers' bf16 forward
    makes the K/V (its DynamicCache) and the first token; mlx-lm's own model in bf16
    continues from that K/V in its own KVCache. None of our engines or codec."""
    import mlx.core as mx
    import torch
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from transformers import AutoModelForCausalLM

    prefill, decode = bf16_agents
    req = remote_request(
        prefill, "Name three planets of the solar system.", N_NEW, raw=False, return_prompt_ids=True
    )
    res = ask(decode, req)
    assert res.metrics.method == "disaggregated"
    ids = res.prompt_ids or []
    # bf16 on the wire: 2 bytes per element, 30 layers x K and V x 3 heads x 64 dims.
    assert (res.metrics.kv_bytes or 0) >= 30 * 2 * 3 * 64 * 2 * len(ids)

    hf = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
    kv = out.past_key_values
    first = int(out.logits[0, -1].float().argmax())
    model = load(str(default_model))[0]
    model.set_dtype(mx.bfloat16)
    cache = make_prompt_cache(model)
    assert len(cache) == len(kv.layers) == 30
    for c, layer in zip(cache, kv.layers, strict=True):
        assert layer.keys.dtype == torch.bfloat16 and layer.keys.shape[-2] == len(ids)
        c.update_and_fetch(_to_mlx(layer.keys), _to_mlx(layer.values))
    # mlx continues from the same bf16 K/V, after the first token transformers chose.
    assert res.token_ids == [first, *mlx_greedy(model, [first], N_NEW - 1, cache=cache)]

"""Embeddings through `disagg serve`'s app over real agents, computed by the prefill agent: the
official `ollama` and `openai` clients and LangChain's OllamaEmbeddings. Pooling
rules are unit-tested on plain files."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
import torch

from disagg.serving.embed import cut
from disagg_agents.models.pooling import pooling_of
from disagg_agents.prefill.embed import pool
from tests.agentpool import AgentSet
from tests.conftest import PairFactory
from tests.gateways import Gateways
from tests.references import hf_embedding
from tests.tinymodels import declare_pooling, shared_tiny

TINY = "tiny-qwen3"


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


# ---- pooling rules (fast) -----------------------------------------------------------------


def test_pooling_from_the_checkpoint(tmp_path: Path) -> None:
    assert pooling_of(tmp_path) == "mean"  # no sentence-transformers config
    declare_pooling(tmp_path, pooling_mode_lasttoken=True, pooling_mode_mean_tokens=False)
    assert pooling_of(tmp_path) == "last"  # as Qwen3-Embedding ships it
    cfg = {"pooling_mode_cls_token": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    assert pooling_of(tmp_path) == "cls"


def test_pool_and_cut_are_normalized() -> None:
    h = torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    assert pool(h, "last").tolist() == [0.0, 1.0, 0.0]
    assert pool(h, "cls").tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(pool(h, "mean"), torch.tensor([0.6, 0.8, 0.0]))
    assert cut([0.6, 0.8, 0.0], 1) == [1.0]
    assert cut([0.6, 0.8], 5) == [0.6, 0.8]


# ---- a real engine in this process (fast): cancel inside an input, limits before compute ----


@pytest.fixture(scope="module")
def embedder() -> Any:
    from disagg_agents.prefill.embed import Embedder
    from disagg_agents.prefill.engine import PrefillEngine

    return Embedder(PrefillEngine(str(shared_tiny("qwen3")), device="cpu", dtype="float32"))


def test_a_hang_up_stops_the_forward_between_layers(embedder: Any) -> None:
    from disagg_agents.prefill.embed import Gone

    ran: list[int] = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
        for i, layer in enumerate(embedder.engine.layers)
    ]
    try:
        with pytest.raises(Gone):  # the client hangs up while layer 1 runs
            embedder.answer({"input": ["The key value cache. " * 200]}, lambda: len(ran) >= 2)
        assert ran == [0, 1]  # layers 2 and 3 never ran
        ran.clear()
        whole = embedder.answer({"input": ["The key value cache."]})  # the hooks are gone
        assert len(ran) == len(embedder.engine.layers) and len(whole["embeddings"]) == 1
    finally:
        for h in hooks:
            h.remove()
    assert not any(layer._forward_pre_hooks for layer in embedder.engine.layers)


def test_an_input_over_the_limit_is_refused_before_its_forward(embedder: Any) -> None:
    text = "The capital of France is Paris. " * 40  # ~200 tokens
    asked: list[int] = []
    hook = embedder.engine.layers[0].register_forward_pre_hook(lambda m, a: asked.append(1))
    try:
        with pytest.raises(ValueError, match="over the limit of 16 per input"):
            embedder.answer({"input": [text], "truncate": False, "max_tokens": 16})
        big = "word " * 200_000  # ~1 MB: refused by its bytes, untokenized
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="at least"):
            embedder.answer({"input": [big], "truncate": False})
        assert time.perf_counter() - t0 < 0.5
        assert not asked
        cut16 = embedder.answer({"input": [text], "max_tokens": 16})  # Ollama's default: cut
        assert cut16["prompt_tokens"] == 16
    finally:
        hook.remove()


# ---- through the gateway (slow) -----------------------------------------------------------


@pytest.fixture(scope="module")
def url(
    agent_pair: PairFactory,
    smol_set: AgentSet,
    gateways: Gateways,
    default_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """`disagg serve`'s app in this process over pooled agents: the shared tiny qwen3,
    which declares last-token pooling (as Qwen3-Embedding ships), and SmolLM2."""
    tiny = shared_tiny("qwen3")
    assert pooling_of(tiny) == "last"
    sets = {TINY: agent_pair.set(tiny), default_model.name: smol_set}
    return gateways.get(sets).url


@pytest.mark.slow
def test_ollama_embed(url: str, default_model: Path) -> None:
    c = ollama.Client(host=url, timeout=300)
    for model, path in ((TINY, shared_tiny("qwen3")), (default_model.name, default_model)):
        texts = ["The capital of France is Paris.", "def add(a, b):"]
        r = c.embed(model=model, input=texts)
        assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 8
        assert all(abs(norm(list(v)) - 1) < 1e-4 for v in r.embeddings)
        # The values: a plain transformers forward, pooled as the checkpoint declares.
        refs = [hf_embedding(path, t, pooling_of(path)) for t in texts]
        for got, (want, _) in zip(r.embeddings, refs, strict=True):
            assert len(got) == len(want)
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, model
        assert r.prompt_eval_count == sum(n for _, n in refs)
        assert r.embeddings[0] != r.embeddings[1] and (r.prompt_eval_count or 0) > 4
        same = c.embed(model=model, input="The capital of France is Paris.")
        assert list(same.embeddings[0]) == list(r.embeddings[0])  # same text, same vector
        cut8 = c.embed(model=model, input="The capital of France is Paris.", dimensions=8)
        assert len(cut8.embeddings[0]) == 8 and abs(norm(list(cut8.embeddings[0])) - 1) < 1e-4
    long = "The key value cache streams over a socket. " * 20
    with pytest.raises(ollama.ResponseError) as too_long:
        c.embed(model=TINY, input=long, truncate=False, options={"num_ctx": 16})
    assert too_long.value.status_code == 400 and "truncate" in str(too_long.value)
    cut = c.embed(model=TINY, input=long, options={"num_ctx": 16})
    assert cut.prompt_eval_count == 16
    legacy = c.embeddings(model=TINY, prompt="The capital of France is Paris.")
    first = c.embed(model=TINY, input="The capital of France is Paris.")
    assert list(legacy.embedding) == list(first.embeddings[0])


@pytest.mark.slow
def test_show_says_embedding_where_the_checkpoint_declares_its_pooling(
    url: str, default_model: Path
) -> None:
    c = ollama.Client(host=url, timeout=300)
    assert "embedding" in (c.show(TINY).capabilities or [])
    assert "embedding" not in (c.show(default_model.name).capabilities or [])


@pytest.mark.slow
def test_openai_and_langchain_embeddings(url: str, default_model: Path) -> None:
    from langchain_ollama import OllamaEmbeddings

    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    text = "Disaggregated inference runs prefill on one machine."
    r = oai.embeddings.create(model=default_model.name, input=[text, "hello"])  # base64 on the wire
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 4
    v = r.data[0].embedding
    assert abs(norm(v) - 1) < 1e-4
    floats = oai.embeddings.create(model=default_model.name, input=text, encoding_format="float")
    assert max(abs(a - b) for a, b in zip(floats.data[0].embedding, v, strict=True)) < 1e-6
    short = oai.embeddings.create(model=default_model.name, input=text, dimensions=16)
    assert len(short.data[0].embedding) == 16
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=default_model.name, input=[[1, 2, 3]])
    # Over the model's limit (tiny: 4096 tokens): OpenAI's 400, never a silent cut.
    with pytest.raises(openai.BadRequestError, match="over the limit of 4096"):
        oai.embeddings.create(model=TINY, input="The key value cache streams. " * 1500)
    lc = OllamaEmbeddings(model=default_model.name, base_url=url)
    docs = lc.embed_documents([text, "hello"])
    assert len(docs) == 2 and abs(norm(docs[0]) - 1) < 1e-4
    assert max(abs(a - b) for a, b in zip(docs[0], v, strict=True)) < 1e-5
    assert lc.embed_query(text) == docs[0]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


@pytest.mark.slow
def test_an_embedding_hung_up_mid_input_frees_the_prefill_agent(
    url: str, smol_set: AgentSet, default_model: Path
) -> None:
    # One ~8k-token input: SmolLM2's forward of it is many seconds on a CPU; its
    # client hangs up 1.5 s in. The agent stops before its next layer.
    pid = smol_set.prefill.proc.pid
    body = {"model": default_model.name, "input": "The key value cache streams. " * 1300}
    try:
        r = httpx.post(f"{url}/api/embed", json=body, timeout=1.5)
    except httpx.ReadTimeout:
        pass
    else:
        pytest.fail(f"answered within 1.5 s ({r.status_code}): nothing left to stop")
    left = time.monotonic()
    idle_at = None
    while time.monotonic() - left < 10:
        before = _cpu_s(pid)
        time.sleep(0.25)
        if _cpu_s(pid) - before < 0.05:
            idle_at = time.monotonic() - left
            break
    print(f"prefill agent idle {idle_at}s after the client hung up mid-input")
    assert idle_at is not None and idle_at < 2.0

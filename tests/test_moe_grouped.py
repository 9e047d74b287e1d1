"""MoE experts as grouped GEMMs: the same function as the per-expert loop they
replace, with no host sync and an op count that does not grow with the experts.

Units on random weights (every weight form and dtype the prefill agent uses), then
`PrefillEngine.prefill` on tiny quantized MoE checkpoints with the user's models'
routing (qwen3_moe 8 of 128 experts in MLX affine 4-bit, gpt_oss 4 of 128 in
OpenAI's MXFP4), counted op by op with a TorchDispatchMode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from disagg.bench.opcount import OpCounter, count_prefill, per_call
from disagg_agents.quant import moe
from disagg_agents.quant.dequant import Packed, QSpec
from disagg_agents.quant.modules import PackedExperts, QuantEmbedding, Weight

HIDDEN, INTER = 64, 32
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dq(w: Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w.expert(e) if isinstance(w, Packed) else w[e].to(dtype)


def loop_forward(
    m: PackedExperts, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The per-expert loop PackedExperts ran before (host syncs: nonzero, int, where)."""
    out = torch.zeros_like(hidden)
    mask = F.one_hot(top_k_index, num_classes=m.num_experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for row in hit:
        e = int(row[0])
        pos, tok = torch.where(mask[e])
        x = hidden[tok]
        g = F.linear(x, dq(m.gate, e, m.dtype))
        u = F.linear(x, dq(m.up, e, m.dtype))
        if m.biases is not None:
            g, u = g + m.biases[0][e], u + m.biases[1][e]
        y = F.linear(m._glu(g, u), dq(m.down, e, m.dtype))
        if m.biases is not None:
            y = y + m.biases[2][e]
        y = y * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def random_weight(form: str, e: int, out: int, n_in: int, dtype: torch.dtype, g: Any) -> Weight:
    """One stacked expert weight [e, out, n_in] as `form`: affine4 / mxfp4 (packed),
    kept (dequantized at load), or plain (left unquantized by the converter)."""
    if form == "plain":
        return (torch.randn(e, out, n_in, generator=g) * 0.2).to(dtype)
    if form == "mxfp4":
        blocks = torch.randint(0, 256, (e, out, n_in // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 125, (e, out, n_in // 32), generator=g, dtype=torch.uint8)
        return Packed(blocks, scales, None, QSpec("mxfp4", 4, 32), n_in, dtype)
    packed = torch.randint(0, 256, (e, out, n_in // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(e, out, n_in // 32, generator=g) * 0.02
    biases = -scales * 7.5
    p = Packed(packed, scales, biases, QSpec("affine", 4, 32), n_in, dtype)
    if form == "kept":
        p.keep()
    return p


def experts(kind: str, form: str, e: int, dtype: torch.dtype, seed: int = 0) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    gate, up = (random_weight(form, e, INTER, HIDDEN, dtype, g) for _ in range(2))
    down = random_weight(form, e, HIDDEN, INTER, dtype, g)
    biases = None
    if kind == "gpt_oss":
        b = [(torch.randn(e, n, generator=g) * 0.1).to(dtype) for n in (INTER, INTER, HIDDEN)]
        biases = (b[0], b[1], b[2])
    return PackedExperts(kind, gate, up, down, e, dtype, biases, act=F.silu)


def routing(t: int, e: int, k: int, dtype: torch.dtype, seed: int = 1) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    top, idx = torch.topk(logits.softmax(-1), k, dim=-1)
    return hidden, idx, (top / top.sum(-1, keepdim=True)).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: to the GEMMs' rounding; bf16/fp16: the loop rounded its sum per expert."""
    scale = float(b.float().abs().max())
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol * max(scale, 1.0))


@pytest.mark.slow  # 32 cases of ~2-3 s of CPU matmuls each: over a minute in all
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["affine4", "mxfp4", "kept", "plain"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("gemm", ["auto", "blocked"])
def test_experts_match_the_per_expert_loop(
    kind: str, form: str, dtype: torch.dtype, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every path (grouped_mm; per-pair blocks for fewer pairs than experts; padded
    blocks) against the loop, on many tokens and on a few (3 x 2 pairs < 16 experts)."""
    monkeypatch.setenv(moe.GEMM_ENV, gemm)
    m = experts(kind, form, 16, dtype)
    for t, k in ((40, 4), (3, 2), (1, 1)):
        hidden, idx, w = routing(t, 16, k, dtype)
        new = m(hidden, idx, w)
        assert new.shape == hidden.shape and new.dtype == hidden.dtype
        close(new, loop_forward(m, hidden, idx, w), dtype)


@pytest.mark.parametrize("block", [1, 3, 64])
def test_blocked_gemm_equals_grouped_mm_on_skewed_routing(block: int) -> None:
    """Empty experts, one expert taking most rows, and the last expert hit."""
    g = torch.Generator().manual_seed(5)
    e, t, k = 8, 37, 2
    idx = torch.randint(0, e, (t, k), generator=g)
    idx[:30, 0] = 3
    idx[:, 1] = torch.where(idx[:, 1] % 2 == 0, 7, idx[:, 1])
    r = moe.route(idx, e)
    x = torch.randn(r.pairs, HIDDEN, generator=g)
    w = torch.randn(e, INTER, HIDDEN, generator=g)
    ref = moe.grouped_linear(x, w, r)
    got = moe.blocked_linear(x, lambda i: w[i], moe.blocked_layout(r, block), block)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    assert torch.equal(r.ends.long(), counts.cumsum(0))


def counted(fn: Callable[[], Any]) -> OpCounter:
    with OpCounter() as c:
        fn()
    return c


@pytest.mark.parametrize("form", ["affine4", "mxfp4", "kept"])
@pytest.mark.parametrize("gemm", ["auto", "blocked"])
def test_experts_forward_has_no_sync_and_ops_do_not_grow_with_experts(
    form: str, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(moe.GEMM_ENV, gemm)
    ops = []
    for e in (8, 128):
        m = experts("gpt_oss", form, e, torch.float32)
        for t in (64, 1):  # grouped (or blocked), and per-pair blocks when packed
            hidden, idx, w = routing(t, e, 4, torch.float32)
            # The first mxfp4 forward of a process builds the E2M1 byte table once (7
            # ops): counted only if no earlier test did, so the count is the second's.
            m(hidden, idx, w)
            c = counted(lambda: m(hidden, idx, w))  # noqa: B023
            assert c.total_syncs == 0, c.scopes["other"].sync_ops
            ops.append(c.total_ops)
    assert ops[:2] == ops[2:], ops


def test_embedding_lookup_is_sync_free_and_unchanged() -> None:
    for kept in (False, True):
        g = torch.Generator().manual_seed(2)
        table = random_weight("affine4", 1, 96, HIDDEN, torch.bfloat16, g)
        assert isinstance(table, Packed) and table.biases is not None
        flat = Packed(
            table.packed[0], table.scales[0], table.biases[0], table.spec, HIDDEN, table.dtype
        )
        uniq, inverse = torch.unique(
            ids := torch.tensor([[5, 0, 5, 95, 17, 0]]), return_inverse=True
        )
        before = flat.rows(uniq)[inverse]  # the lookup it replaced
        if kept:
            flat.keep()
        emb = QuantEmbedding(flat)
        c = counted(lambda: emb(ids))  # noqa: B023
        assert c.total_syncs == 0
        assert torch.equal(emb(ids), before)


# --- PrefillEngine.prefill on tiny quantized MoE checkpoints -----------------------

PROMPT_IDS = [(i * 7919 + 13) % 300 for i in range(256)]
ENGINES: dict[tuple[str, float | None], Any] = {}


def engine(name: str, budget: float | None) -> Any:
    """A prefill engine on tests/quantmodels' `name`: weights kept dequantized (budget
    None: as memory allows) or all packed (budget 0)."""
    from disagg_agents.prefill.engine import PrefillEngine
    from tests.quantmodels import quant_dir

    key = (name, budget)
    if key not in ENGINES:
        ENGINES[key] = PrefillEngine(str(quant_dir(name)), device="cpu", dequant_budget_gb=budget)
    return ENGINES[key]


PAIRS = [("moe32-affine4", "moe128-affine4"), ("gptoss32-hf-mxfp4", "gptoss128-hf-mxfp4")]


@pytest.mark.slow  # real quantized checkpoints, loaded and prefilled
@pytest.mark.parametrize("budget", [None, 0.0], ids=["kept", "packed"])
@pytest.mark.parametrize("pair", PAIRS, ids=["qwen3_moe-affine4", "gpt_oss-mxfp4"])
def test_prefill_moe_layers_have_no_host_sync(pair: tuple[str, str], budget: float | None) -> None:
    """0 syncs per MoE layer (and in the whole prefill); ops per MoE layer at 128
    experts within 1.2x those at 32 (the loop grew 3.8x)."""
    per_layer = []
    for name in pair:
        eng = engine(name, budget)
        assert (eng.kept_bytes > 0) == (budget is None)
        c = count_prefill(eng, PROMPT_IDS)
        ops, syncs = per_call(c, "moe")
        assert c.scopes["moe"].calls >= 3 and syncs == 0
        assert c.total_syncs == 0, {k: dict(v.sync_ops) for k, v in c.scopes.items()}
        per_layer.append(ops)
    assert per_layer[1] <= 1.2 * per_layer[0], per_layer


@pytest.mark.slow  # real quantized checkpoints, loaded and prefilled
@pytest.mark.parametrize("name", ["moe128-affine4", "gptoss128-hf-mxfp4"])
def test_weights_kept_at_load_compute_what_packed_ones_do(name: str) -> None:
    """Dequantized once at load or on every forward: the same bits in, the same out."""
    kept, packed = engine(name, None), engine(name, 0.0)
    assert kept.packed_bytes == packed.packed_bytes > 0 and packed.kept_bytes == 0
    outs = [e.prefill(PROMPT_IDS, lambda kv: None)[1] for e in (kept, packed)]
    assert (outs[0] == outs[1]).all()

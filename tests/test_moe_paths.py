"""Experts read as stored: which MoE path each layer takes, named at load.

Where the fused kernel runs (CUDA with Triton) experts stay packed, gate and up
are budgeted as one (a budget that ends between them keeps neither), and a layer
on a slower path than the device's best says why, once. No GPU here: the device
is described by its facts (type, capability, Triton), which is all the choice
reads; the checkpoints are real (tests/quantmodels: mlx_lm.convert's 4-bit
qwen3_moe, OpenAI-layout MXFP4 gpt_oss).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from disagg_agents.quant import moe_triton
from disagg_agents.quant.dequant import Packed, QSpec
from disagg_agents.quant.modules import PackedExperts, QuantLinear, Weight
from disagg_agents.quant.paths import DeviceFacts, layer_path, log_slow, moe_paths
from disagg_agents.wire.status import AgentStatus, MoePath

GB10 = DeviceFacts("cuda", (12, 1), triton=True)
H200 = DeviceFacts("cuda", (9, 0), triton=True)
CPU = DeviceFacts("cpu")
HIDDEN, INTER, EXPERTS = 64, 32, 8


def weight(form: str, out: int, n_in: int, g: torch.Generator) -> Weight:
    """[EXPERTS, out, n_in] as stored: affine4, affine3 (a form the kernel does not
    read), mxfp4, kept (affine4 dequantized at load) or plain bf16."""
    if form == "plain":
        return torch.randn(EXPERTS, out, n_in, generator=g).to(torch.bfloat16)
    if form == "mxfp4":
        blocks = torch.randint(0, 256, (EXPERTS, out, n_in // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(119, 126, (EXPERTS, out, n_in // 32), generator=g, dtype=torch.uint8)
        return Packed(blocks, scales, None, QSpec("mxfp4", 4, 32), n_in, torch.bfloat16)
    bits = 3 if form == "affine3" else 4
    packed = torch.randint(0, 256, (EXPERTS, out, n_in * bits // 8), generator=g, dtype=torch.uint8)
    scales = torch.rand(EXPERTS, out, n_in // 32, generator=g)
    p = Packed(packed, scales, -scales, QSpec("affine", bits, 32), n_in, torch.bfloat16)
    if form == "kept":
        p.keep()
    return p


def layer(gate: str, up: str, down: str, kind: str = "qwen3_moe") -> PackedExperts:
    g = torch.Generator().manual_seed(0)
    w = [weight(f, o, i, g) for f, o, i in ((gate, INTER, HIDDEN), (up, INTER, HIDDEN))]
    d = weight(down, HIDDEN, INTER, g)
    return PackedExperts(kind, w[0], w[1], d, EXPERTS, torch.bfloat16, act=torch.nn.SiLU())


def test_each_layer_names_its_path_and_why_it_is_slower_than_the_best() -> None:
    fused = layer("affine4", "affine4", "affine4")
    assert layer_path(0, fused, GB10) == MoePath(0, "triton", "triton")
    assert layer_path(0, layer("mxfp4", "mxfp4", "mxfp4", "gpt_oss"), GB10).path == "triton"
    # Gate kept, up packed: the kernel reads both in one form, so the layer falls back.
    split = layer_path(3, layer("kept", "affine4", "affine4"), GB10)
    assert (split.path, split.best) == ("blocked", "triton")
    assert "gate is kept in bfloat16 and up packed affine 4-bit" in split.reason
    odd = layer_path(1, layer("affine3", "affine3", "affine3"), GB10)
    assert odd.path == "blocked" and "affine 3-bit, group 32, a form" in odd.reason
    # On sm_90 weights kept in bf16 take grouped_mm's fast kernel: as fast, no reason.
    assert layer_path(0, layer("plain", "plain", "plain"), H200) == MoePath(0, "grouped", "triton")
    assert layer_path(0, layer("kept", "affine4", "affine4"), H200).path == "grouped"
    assert layer_path(0, fused, CPU) == MoePath(0, "grouped", "grouped")
    assert layer_path(0, fused, DeviceFacts("mps")) == MoePath(0, "blocked", "blocked")


def test_the_reason_is_the_one_the_kernels_refuse_with() -> None:
    """paths reads moe_triton's own refusal: a layer has a reason exactly when
    prepare() gives it up (so the two cannot drift), an activation included."""
    gelu = layer("affine4", "affine4", "affine4")
    gelu.act = torch.nn.GELU()
    cases = [layer("affine4", "affine4", "affine4"), layer("kept", "affine4", "affine4"),
             layer("affine3", "affine3", "affine3"), gelu]  # fmt: skip
    for mod in cases:
        why = layer_path(0, mod, GB10).reason
        weights = (mod.gate, mod.up, mod.down)
        prepared = moe_triton.prepare(mod.kind, weights, mod.biases, mod.act, mod.alpha, mod.limit)
        assert (prepared is None) == bool(why), why
    assert "qwen3_moe's activation GELU" in layer_path(0, gelu, GB10).reason


def test_slow_layers_are_one_log_line_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    paths = [MoePath(i, "triton", "triton") for i in range(4)]
    paths[1] = MoePath(1, "blocked", "triton", "gate is kept and up packed")
    paths[3] = MoePath(3, "blocked", "triton", "gate is kept and up packed")
    with caplog.at_level(logging.WARNING, logger="disagg.prefill"):
        lines = log_slow(paths)
    assert lines == ["MoE layers 1, 3: the blocked path, not triton: gate is kept and up packed"]
    assert [r.getMessage() for r in caplog.records] == lines
    assert log_slow([MoePath(0, "triton", "triton")]) == []


def test_status_reads_the_paths_typed_and_drops_mistyped_entries() -> None:
    doc = {
        "moe_paths": [
            {"layer": 0, "path": "triton", "best": "triton", "reason": ""},
            {"layer": "1", "path": "blocked", "best": "triton"},
            {"layer": 2, "path": "blocked", "best": "triton", "reason": "why"},
            "junk",
        ]
    }
    st = AgentStatus.from_json(doc)
    assert st.moe_paths == (MoePath(0, "triton", "triton"), MoePath(2, "blocked", "triton", "why"))
    assert st.mistyped == ("moe_paths",)  # what it dropped, `disagg status` names
    odd = AgentStatus.from_json({"moe_paths": {"0": "triton"}})
    assert (odd.moe_paths, odd.mistyped) == ((), ("moe_paths",))


# --- real checkpoints, loaded on the CPU ---------------------------------------------


def load(name: str, budget: int, experts_packed: bool) -> tuple[Any, int, int]:
    from disagg_agents.models import load_hf_config
    from disagg_agents.quant.loader import load_packed_model
    from tests.quantmodels import quant_dir

    path = quant_dir(name)
    return load_packed_model(
        path, load_hf_config(str(path)), torch.float32, "cpu", budget, experts_packed
    )


def experts(model: Any) -> list[PackedExperts]:
    return [m for m in model.modules() if isinstance(m, PackedExperts)]


def kept_at_load(w: Weight) -> bool:
    return isinstance(w, Packed) and w.kept is not None


def grow(w: Weight) -> int:
    assert isinstance(w, Packed)
    return w.full_nbytes - w.nbytes


NAMES = ["moe32-affine4", "gptoss32-hf-mxfp4"]


@pytest.mark.slow  # real quantized checkpoints, loaded three times each
@pytest.mark.parametrize("name", NAMES)
def test_a_budget_ending_between_gate_and_up_keeps_both_one_form_on_the_fused_path(
    name: str,
) -> None:
    """Budgets cut in the middle of each of the first two layers' up: gate and up
    always end in one form, and every layer is one the fused kernel reads."""
    first = experts(load(name, 0, False)[0])
    spent = 0
    for cut in first[:2]:
        budget = spent + grow(cut.gate) + grow(cut.up) // 2
        model, _, kept = load(name, budget, False)
        layers = experts(model)
        for m in layers:
            assert isinstance(m.gate, Packed) and isinstance(m.up, Packed)
            assert (m.gate.kept is None) == (m.up.kept is None), name
        assert not kept_at_load(layers[first.index(cut)].gate)  # the cut layer: neither
        assert kept > 0 or spent == 0
        assert all(p.path == "triton" and not p.reason for p in moe_paths(model, GB10))
        spent += grow(cut.gate) + grow(cut.up) + grow(cut.down)


@pytest.mark.slow  # real quantized checkpoints, loaded once each
@pytest.mark.parametrize("name", NAMES)
def test_where_the_fused_kernel_runs_no_expert_is_kept_and_dense_layers_keep_their_rule(
    name: str,
) -> None:
    model, packed, kept = load(name, 1 << 40, GB10.fused)
    assert packed > 0
    for m in experts(model):
        assert all(isinstance(w, Packed) and w.kept is None for w in (m.gate, m.up, m.down))
    # Everything else quantized (attention, router, embedding): kept, as the budget allows.
    dense = {id(p): p for m in model.modules() if isinstance(p := m.__dict__.get("packed"), Packed)}
    assert all(p.kept is not None for p in dense.values())
    assert kept == sum(p.nbytes for p in dense.values())
    assert any(isinstance(m, QuantLinear) for m in model.modules()) == (name == "moe32-affine4")
    assert [p.path for p in moe_paths(model, GB10)] == ["triton"] * len(experts(model))
    # The same budget where the kernel does not run keeps the experts too.
    assert all(kept_at_load(m.gate) for m in experts(load(name, 1 << 40, False)[0]))


@pytest.mark.slow  # a real quantized checkpoint in a prefill engine (no process)
def test_the_prefill_agents_status_lists_each_moe_layers_path() -> None:
    from disagg_agents.prefill.agent import PrefillAgent
    from disagg_agents.prefill.engine import PrefillEngine
    from tests.quantmodels import quant_dir

    eng = PrefillEngine(str(quant_dir("moe32-affine4")), device="cpu", dequant_budget_gb=0.0)
    st = AgentStatus.from_json(PrefillAgent(eng, "p").status().as_json())
    moe = [int(n.split(".")[2]) for n, m in eng.model.named_modules() if m in experts(eng.model)]
    assert moe and st.moe_paths == tuple(MoePath(i, "grouped", "grouped") for i in moe)
    assert st.mistyped == ()  # a real prefill agent's /status reads whole


@pytest.mark.slow  # a real quantized checkpoint in a prefill engine (no process)
def test_a_prefill_engine_on_a_gb10s_facts_keeps_no_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine asks the device's facts (here a GB10's, the weights on the CPU) and
    loads with them: no expert kept, whatever memory allows; every layer fused."""
    from disagg_agents.prefill import engine as engine_mod
    from tests.quantmodels import quant_dir

    monkeypatch.setattr(engine_mod.DeviceFacts, "of", classmethod(lambda cls, device: GB10))
    eng = engine_mod.PrefillEngine(str(quant_dir("gptoss32-hf-mxfp4")), device="cpu")
    layers = experts(eng.model)
    assert layers and not any(kept_at_load(w) for m in layers for w in (m.gate, m.up, m.down))
    assert [p.path for p in eng.moe_paths] == ["triton"] * len(layers)

"""The fused Triton MoE kernels (disagg_agents.quant.moe_triton) against the reference:
each routed expert's weight dequantized (mlx-exact, `Packed.expert`), then a
matmul per expert, the routing weights applied and the slots summed.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors: the same
kernel source the prefill agent launches on CUDA, numpy underneath. On a CUDA
machine (scripts/device-cuda.sh) the same tests run natively.
"""

from __future__ import annotations

import logging
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before the kernels' module is imported: `triton.jit` reads it then
    os.environ["TRITON_INTERPRET"] = "1"

from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from disagg.bench.opcount import OpCounter  # noqa: E402
from disagg_agents.quant import moe, moe_kernels, moe_triton  # noqa: E402
from disagg_agents.quant.dequant import Packed, QSpec  # noqa: E402
from disagg_agents.quant.modules import PackedExperts, Weight  # noqa: E402
from tests.test_moe_grouped import loop_forward  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
HIDDEN, INTER, EXPERTS = 64, 128, 16  # 32-wide tiles: several per output, K loops of 2 and 4


def weight(
    form: str, out: int, n_in: int, dtype: torch.dtype, g: torch.Generator, e: int = EXPERTS
) -> Weight:
    """A stacked [e, out, n_in] weight as stored: affine4/affine8 (MLX, group 32 and
    64), mxfp4 (E2M1 + E8M0), kept (affine4 dequantized at load) or plain."""
    if form == "plain":
        return (torch.randn(e, out, n_in, generator=g) * 0.2).to(dtype)
    if form == "mxfp4":
        blocks = torch.randint(0, 256, (e, out, n_in // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(119, 126, (e, out, n_in // 32), generator=g, dtype=torch.uint8)
        return Packed(blocks, scales, None, QSpec("mxfp4", 4, 32), n_in, dtype)
    bits, group = (8, 64) if form == "affine8" else (4, 32)
    packed = torch.randint(0, 256, (e, out, n_in * bits // 8), generator=g, dtype=torch.uint8)
    scales = torch.rand(e, out, n_in // group, generator=g) * (0.3 / (1 << bits))
    biases = -scales * ((1 << bits) - 1) / 2
    p = Packed(packed, scales, biases, QSpec("affine", bits, group), n_in, dtype)
    if form == "kept":
        p.keep()
    return p


def layer(kind: str, form: str, dtype: torch.dtype, seed: int = 0) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    gate, up = (weight(form, INTER, HIDDEN, dtype, g) for _ in range(2))
    down = weight(form, HIDDEN, INTER, dtype, g)
    biases = None
    if kind == "gpt_oss":
        b = [(torch.randn(EXPERTS, n, generator=g) * 0.1).to(dtype) for n in (INTER, INTER, HIDDEN)]
        biases = (b[0], b[1], b[2])
    m = PackedExperts(kind, gate, up, down, EXPERTS, dtype, biases, act=torch.nn.SiLU())
    return moved(m, DEVICE)


def moved(m: PackedExperts, device: torch.device) -> PackedExperts:
    for name in ("gate", "up", "down"):
        w = getattr(m, name)
        setattr(m, name, w.to(device))
    if m.biases is not None:
        m.biases = tuple(b.to(device) for b in m.biases)  # type: ignore[assignment]
    return m


def skewed_routing(t: int, k: int, dtype: torch.dtype, seed: int = 1) -> tuple[Any, ...]:
    """t tokens, top-k of EXPERTS: experts 0-3 get no rows, expert 5 most of them,
    the last expert some; per-expert counts not multiples of any block size."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(t, EXPERTS, generator=g)
    logits[:, :4] = -1e9
    logits[: (2 * t) // 3, 5] += 50.0
    top, idx = torch.topk(logits.softmax(-1), k, dim=-1)
    w = (top / top.sum(-1, keepdim=True)).to(dtype)
    return hidden.to(DEVICE), idx.to(DEVICE), w.to(DEVICE)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: to the sum order's rounding. bf16: the reference rounds every op to bf16
    (and the interpreter converts fp32 -> bf16 by truncation), the kernel keeps fp32
    inside: within 2 % of the output's scale."""
    scale = max(float(b.float().abs().max()), 1.0)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol * scale)


FORMS = ["affine4", "affine8", "mxfp4", "kept", "plain"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("kind", "k"), [("qwen3_moe", 8), ("gpt_oss", 4)])
def test_kernel_equals_dequantize_then_matmul_per_expert(
    kind: str, k: int, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32, 37 tokens (no block size divides the per-expert counts), top-8 (qwen3_moe
    SwiGLU) and top-4 (gpt_oss clamped GLU with biases); a single token too."""
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    m = layer(kind, form, torch.float32)
    for t in (37, 1):
        hidden, idx, w = skewed_routing(t, k, torch.float32)
        got = m(hidden, idx, w)
        assert m._triton, "the Triton path did not run"
        assert got.shape == hidden.shape and got.dtype == hidden.dtype
        close(got, loop_forward(m, hidden, idx, w), torch.float32)


@pytest.mark.parametrize("form", ["affine4", "mxfp4", "plain"])
def test_kernel_in_bf16(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    m = layer("gpt_oss", form, torch.bfloat16)
    hidden, idx, w = skewed_routing(29, 4, torch.bfloat16)
    close(m(hidden, idx, w), loop_forward(m, hidden, idx, w), torch.bfloat16)


@pytest.mark.parametrize("forced", ["32,64,64,1,1", "64,64,64,4,2,1"])
def test_the_tiles_override_runs_here_too(forced: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DISAGG_MOE_TILES is what forward launches with, interpreted or not (so the
    tile sweep's CPU smoke runs distinct tiles), and the answer is the reference's."""
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    monkeypatch.setenv(moe_triton.TILES_ENV, forced)
    m = layer("qwen3_moe", "affine4", torch.float32)
    s = moe_triton.stored(m.gate)
    assert s is not None
    want = moe_triton.Tiles(*(int(v) for v in forced.split(",")))
    assert moe_triton.tiles(DEVICE, 296, EXPERTS, "gate_up", s) == want != moe_triton.INTERPRETED
    hidden, idx, w = skewed_routing(37, 8, torch.float32)
    close(m(hidden, idx, w), loop_forward(m, hidden, idx, w), torch.float32)


def test_affine_dequantization_in_the_kernel_is_mlx_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token, one expert, weight 1 and x a one-hot: the kernel's output is one
    column of the dequantized weight, bit for bit (fp32)."""
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    g = torch.Generator().manual_seed(3)
    for form in ("affine4", "affine8", "mxfp4"):
        w = weight(form, INTER, HIDDEN, torch.float32, g)
        assert isinstance(w, Packed)
        w = w.to(DEVICE)
        fused = moe_triton.prepare("qwen3_moe", (w, w, w), None, F.silu, 1.0, 7.0)
        assert fused is not None
        x = torch.zeros(1, HIDDEN, device=DEVICE)
        x[0, 7] = 1.0
        r = moe.route(torch.tensor([[2]], device=DEVICE), EXPERTS)
        y = x.new_empty(1, INTER)
        t = moe_triton.tiles(x.device, 1, EXPERTS, "gate_up", fused.gate)
        moe_triton._launch(
            x, fused.gate, None, y, moe_triton.blocks(r, t.bm), t, tokens=r.tokens, glu=0,
            bias=None, row_weights=None, out_rows=None, alpha=1.0, limit=7.0,
        )  # fmt: skip
        want = w.expert(2)[:, 7]
        # The interpreter computes as written. A GPU compiler may contract q*scale + bias
        # into one fma in fp32 (one rounding, not two): a last-bit difference there.
        ulps = 0 if not CUDA else 2
        diff = (y[0] - want).abs().max().item()
        assert diff <= ulps * 2**-23 * want.abs().max().item(), (form, diff)


@pytest.mark.parametrize("bm", [1, 16, 64])
def test_blocks_cover_every_row_once_with_one_expert_each(bm: int) -> None:
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 8, (53, 3), generator=g)
    idx[:40, 0] = 6
    r = moe.route(idx, 8)
    ex, start, end = moe_triton.blocks(r, bm)
    seen = torch.zeros(r.pairs, dtype=torch.int64)
    for e, s, n in zip(ex.tolist(), start.tolist(), end.tolist(), strict=True):
        assert 0 <= n - s <= bm
        seen[s:n] += 1
        assert (r.experts[s:n] == e).all()
    assert (seen == 1).all()


def test_forward_has_no_sync_and_ops_do_not_grow_with_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    ops = []
    for e in (8, 64):
        g = torch.Generator().manual_seed(0)
        gate, up = (weight("mxfp4", 32, 64, torch.float32, g, e) for _ in range(2))
        down = weight("mxfp4", 64, 32, torch.float32, g, e)
        m = moved(PackedExperts("gpt_oss", gate, up, down, e, torch.float32), DEVICE)
        hidden = torch.randn(32, 64, generator=g).to(DEVICE)
        idx = torch.randint(0, e, (32, 4), generator=g).to(DEVICE)
        w = torch.full((32, 4), 0.25, device=DEVICE)
        with OpCounter() as c:
            m(hidden, idx, w)
        assert c.total_syncs == 0, c.scopes["other"].sync_ops
        ops.append(c.total_ops)
    assert ops[0] == ops[1], ops


def test_auto_picks_triton_on_cuda_only_and_forcing_it_elsewhere_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = moe.route(torch.zeros(4, 2, dtype=torch.long), 8)
    x = torch.zeros(4, 8)
    monkeypatch.setenv(moe.GEMM_ENV, "auto")
    assert moe.pick_gemm(x, torch.float32, False, r, triton_ok=True)[0] != "triton"
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    with pytest.raises(RuntimeError, match="need CUDA"):
        moe.pick_gemm(x, torch.float32, False, r, triton_ok=False)
    monkeypatch.setenv(moe.GEMM_ENV, "fastest")
    with pytest.raises(ValueError, match="expected one of"):
        moe.pick_gemm(x, torch.float32, False, r)


def test_a_compile_error_falls_back_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Kernels that do not build (as under a ptxas that rejects sm_121a): found when
    the layer is first prepared, every layer then takes the torch path and gives
    the reference's output, and one log line names the error and the path."""
    from disagg_agents.quant import moe_kernels

    class Broken:  # what a launch raises when the compile fails
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("PTXASError: Value 'sm_121a' is not defined for 'gpu-name'")

            return launch

    monkeypatch.setattr(moe_kernels, "moe_gemm_kernel", Broken())
    monkeypatch.setattr(moe_triton, "_warmed", {})
    monkeypatch.setenv(moe.GEMM_ENV, "auto")
    hidden, idx, w = skewed_routing(21, 4, torch.float32)
    with caplog.at_level(logging.WARNING, logger="disagg.prefill"):
        for seed in (0, 1):  # two layers, each called twice
            m = layer("gpt_oss", "mxfp4", torch.float32, seed=seed)
            assert m.path(DEVICE) == "torch"
            for _ in range(2):
                close(m(hidden, idx, w), loop_forward(m, hidden, idx, w), torch.float32)
            assert m._triton is False
    lines = [r.getMessage() for r in caplog.records if "did not compile" in r.getMessage()]
    assert len(lines) == 1, lines
    path = "grouped" if moe.grouped_mm_fits(DEVICE, torch.float32) else "blocked"
    assert "sm_121a" in lines[0] and f"the {path} path" in lines[0], lines


def test_the_layers_warm_at_load_and_name_their_path() -> None:
    """warm_experts: each PackedExperts layer prepared (and its kernels compiled) now."""
    from disagg_agents.quant.modules import warm_experts

    model = torch.nn.ModuleList(
        [layer("qwen3_moe", "affine4", torch.float32, seed=s) for s in (0, 1)]
    )
    paths = warm_experts(model, DEVICE)
    assert paths == {"triton": 2}
    assert all(isinstance(m._triton, moe_triton.Experts) for m in model)


@triton.jit
def launch_order_kernel(out_ptr, NB, NN, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    b, n = moe_kernels.swizzle(pid, NB, NN, GROUP_M)
    tl.store(out_ptr + 2 * pid, b)
    tl.store(out_ptr + 2 * pid + 1, n)


@pytest.mark.parametrize("group_m", [1, 3])
def test_the_kernels_launch_order_is_the_one_the_traffic_count_walks(group_m: int) -> None:
    """moe_kernels.swizzle, run by Triton, maps each program to the (block, N tile)
    that moetiles.program_order gives it (which the traffic count and the cost
    model's row reads walk)."""
    from disagg_agents.models.moetiles import program_order

    nb, nn = 7, 5
    out = torch.full((nb * nn, 2), -1, dtype=torch.int32, device=DEVICE)
    launch_order_kernel[(nb * nn,)](out, nb, nn, GROUP_M=group_m)
    assert [tuple(p) for p in out.tolist()] == program_order(nb, nn, group_m)


# --- whole prefills of tiny quantized MoE checkpoints --------------------------------

PROMPT_IDS = [(i * 7919 + 13) % 300 for i in range(48)]


def greedy_per_position(eng: Any) -> torch.Tensor:
    """The greedy next token at every position of the prompt (teacher-forced)."""
    ids = torch.tensor([PROMPT_IDS], device=eng.device)
    with torch.inference_mode():
        out = eng.body(input_ids=ids)
        return eng.head(out.last_hidden_state)[0].argmax(-1).cpu()


def prefill_and_greedy(eng: Any) -> tuple[torch.Tensor, Any]:
    """One `eng.prefill` of the prompt (the prefill agent's own forward): the greedy
    next token at every position (the LM head over the body's output, teacher-forced)
    and the last position's logits it returns, which the first token is sampled from."""
    hidden: list[torch.Tensor] = []
    hook = eng.body.register_forward_hook(lambda _m, _a, out: hidden.append(out.last_hidden_state))
    try:
        _, logits = eng.prefill(PROMPT_IDS, lambda kv: None)
    finally:
        hook.remove()
    (states,) = hidden
    assert states.shape[1] == len(PROMPT_IDS)
    with torch.inference_mode():
        return eng.head(states)[0].argmax(-1).cpu(), logits


@pytest.mark.slow  # real quantized checkpoints, prefilled twice (the kernels interpreted)
@pytest.mark.parametrize("name", ["moe32-affine4", "gptoss32-hf-mxfp4"])
def test_prefill_with_the_kernels_gives_the_default_paths_greedy_tokens(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen3_moe in MLX affine 4-bit, gpt_oss in OpenAI's MXFP4, weights packed:
    DISAGG_MOE_GEMM=triton against the default path, token for token, and the
    first token the prefill agent samples from."""
    from disagg_agents.prefill.engine import PrefillEngine
    from tests.quantmodels import quant_dir

    eng = PrefillEngine(str(quant_dir(name)), device=str(DEVICE), dequant_budget_gb=0.0)
    # One prefill per path (each position's greedy token from its forward, too): the
    # interpreted kernels run over the prompt once, not twice.
    monkeypatch.setenv(moe.GEMM_ENV, "blocked" if CUDA else "auto")
    want, want_logits = prefill_and_greedy(eng)
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    got, got_logits = prefill_and_greedy(eng)
    assert any(isinstance(m, PackedExperts) and m._triton for m in eng.model.modules())
    assert torch.equal(got, want), (got != want).nonzero().reshape(-1).tolist()
    assert got_logits.argmax() == want_logits.argmax()


@pytest.mark.slow  # a tiny full-precision checkpoint, prefilled twice (the kernels interpreted)
def test_a_full_precision_qwen3_moe_runs_the_kernels_over_transformers_own_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unquantized checkpoint loads through transformers; where the kernels run,
    its experts become PackedExperts over views of the same tensors (no copy)."""
    from disagg_agents.prefill.engine import PrefillEngine
    from tests.tinymodels import shared_tiny

    path = str(shared_tiny("qwen3_moe"))
    monkeypatch.setenv(moe.GEMM_ENV, "blocked" if CUDA else "auto")
    want = greedy_per_position(PrefillEngine(path, device=str(DEVICE)))
    monkeypatch.setenv(moe.GEMM_ENV, "triton")
    eng = PrefillEngine(path, device=str(DEVICE))
    swapped = [m for m in eng.model.modules() if isinstance(m, PackedExperts)]
    assert swapped and all(isinstance(m.gate, torch.Tensor) for m in swapped)
    gate, up = swapped[0].gate, swapped[0].up
    assert isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)
    storage = [w.untyped_storage().data_ptr() for w in (gate, up)]
    assert storage[0] == storage[1]  # both views of transformers' gate_up_proj
    got = greedy_per_position(eng)
    assert all(m._triton for m in swapped)
    assert torch.equal(got, want), (got != want).nonzero().reshape(-1).tolist()

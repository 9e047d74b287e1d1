"""Prefill attention without the n x n matrix (disagg_agents.prefill.attention):
equal to transformers' eager gpt-oss attention (sinks, sliding window, full
layers, a cached prefix), memory linear in the prompt as a dispatch mode counts
it, and a whole tiny gpt_oss prefill with the same greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disagg_agents.prefill.attention import ATTENTION, chunked_attention, use_chunked_attention


class Biggest(TorchDispatchMode):
    """The largest tensor any aten op returns while active: numel and bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


class _Module(torch.nn.Module):
    """What transformers' eager gpt-oss attention reads off its module."""

    def __init__(self, groups: int, sinks: torch.Tensor) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.sinks = torch.nn.Parameter(sinks, requires_grad=False)


def eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """transformers' own eager gpt-oss attention, mask built as its masking_utils
    builds it (causal; a sliding layer: q - k < window). Returns [B, H, q, D]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    h, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    qpos = torch.arange(kv_len - q_len, kv_len)[:, None]
    kpos = torch.arange(kv_len)[None, :]
    ok = kpos <= qpos
    if window:
        ok &= qpos - kpos < window
    mask = torch.where(ok, 0.0, torch.finfo(q.dtype).min).to(q.dtype)[None, None]
    # No sink: a logit of -inf's stand-in adds nothing to the denominator.
    s = sinks if sinks is not None else torch.full((h,), -1e4, dtype=q.dtype)
    module = _Module(h // k.shape[1], s).eval()
    out, _ = eager_attention_forward(module, q, k, v, mask, q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("window", [None, 8, 128, 256])  # 256: a window past the prompt
@pytest.mark.parametrize(("q_len", "kv_len", "chunk"), [(150, 150, 64), (45, 150, 16), (1, 150, 8)])
def test_equals_eager(sinks: bool, window: int | None, q_len: int, kv_len: int, chunk: int) -> None:
    # q_len < kv_len: a cached prefix (or a decode step); chunks not dividing q_len.
    g = torch.Generator().manual_seed(q_len * 1000 + (window or 0))
    h, hkv, d = 8, 2, 16
    q = torch.randn(1, h, q_len, d, generator=g)
    k = torch.randn(1, hkv, kv_len, d, generator=g)
    v = torch.randn(1, hkv, kv_len, d, generator=g)
    s = 2 * torch.randn(h, generator=g) if sinks else None
    want = eager(q, k, v, window, s)
    got = chunked_attention(q, k, v, d**-0.5, window, s, chunk=chunk)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_equals_eager_bf16() -> None:
    # The Spark computes in bf16: same rounding tolerance as two bf16 kernels.
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 8, 200, 64, generator=g).bfloat16()
    k = torch.randn(1, 1, 200, 64, generator=g).bfloat16()
    v = torch.randn(1, 1, 200, 64, generator=g).bfloat16()
    s = torch.randn(8, generator=g).bfloat16()
    for window in (None, 16):
        want = eager(q.float(), k.float(), v.float(), window, s.float())
        got = chunked_attention(q, k, v, 64**-0.5, window, s, chunk=64).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _gpt_oss_attention(layer_type: str, impl: str) -> tuple[Any, Any, int]:
    """A transformers GptOssAttention of gpt-oss' head shape (head_dim 64, sinks,
    GQA, window 128) with few heads, so 8k tokens run in seconds here."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssAttention,
        GptOssRotaryEmbedding,
    )

    cfg = GptOssConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=128,
        layer_types=[layer_type],
        num_hidden_layers=1,
    )
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    attn = GptOssAttention(cfg, 0).eval()
    with torch.no_grad():
        attn.sinks.normal_()
    return attn, GptOssRotaryEmbedding(cfg), cfg.hidden_size


def _biggest(layer_type: str, impl: str, n: int) -> int:
    attn, rope, hidden = _gpt_oss_attention(layer_type, impl)
    x = torch.randn(1, n, hidden)
    cos_sin = rope(x, torch.arange(n)[None])
    with torch.inference_mode(), Biggest() as seen:
        attn(x, cos_sin, attention_mask=None)
    return seen.bytes


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_memory_linear_in_prompt(layer_type: str) -> None:
    from disagg_agents.prefill.attention import register

    small, large = _biggest(layer_type, register(), 2048), _biggest(layer_type, register(), 8192)
    assert large / small <= 4.5, (small, large)


def test_counter_sees_eager_quadratic() -> None:
    # The counter is not blind: eager's scores grow 4x per doubling of the prompt.
    small = _biggest("full_attention", "eager", 256)
    large = _biggest("full_attention", "eager", 512)
    assert large / small >= 3.5, (small, large)


def test_tiny_gpt_oss_same_greedy_tokens() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from disagg_agents.prefill.engine import PrefillEngine
    from tests.tinymodels import PROMPT, shared_tiny

    path = shared_tiny("gpt_oss")  # sliding window 8, sinks, full and sliding layers
    tok: Any = AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor([tok.encode(PROMPT * 2)])
    assert ids.shape[1] > 4 * 8
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert model.config._attn_implementation == "eager"
    greedy: dict[str, Any] = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        before = model.generate(ids, **greedy)
        logits_before = model(ids).logits[0, -1]
        use_chunked_attention(model)
        assert model.config._attn_implementation == ATTENTION
        after = model.generate(ids, **greedy)
        logits_after = model(ids).logits[0, -1]
    assert after.tolist() == before.tolist()
    torch.testing.assert_close(logits_after, logits_before, atol=1e-4, rtol=1e-4)

    # The prefill engine runs gpt_oss on it, and hands over the same last logits.
    engine = PrefillEngine(str(path), device="cpu", dtype="float32")
    assert engine.model.config._attn_implementation == ATTENTION
    _, logits = engine.prefill(ids[0].tolist(), lambda kv: None)
    torch.testing.assert_close(torch.from_numpy(logits), logits_before, atol=1e-4, rtol=1e-4)


def _ops(q_len: int, kv_len: int, window: int | None, sinks: bool) -> tuple[int, int]:
    """(aten ops, SDPA calls) of one chunked_attention at gpt-oss' head shape."""
    from disagg.bench.opcount import OpCounter

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, q_len, 64, generator=g)
    k, v = (torch.randn(1, 1, kv_len, 64, generator=g) for _ in range(2))
    s = torch.randn(4, generator=g) if sinks else None
    with OpCounter() as c:
        chunked_attention(q, k, v, 0.125, window, s)
    by = c.scopes["other"].by_op
    return c.total_ops, sum(n for op, n in by.items() if "scaled_dot_product" in op)


@pytest.mark.parametrize("sinks", [True, False])
def test_a_sliding_layer_is_a_few_ops_at_any_prompt_length(sinks: bool) -> None:
    """Window 128: one banded call for 512 and for 4,096 queries (64-query chunks
    dispatched ~11 ops per 64 queries: 752 ops at 2,048)."""
    small, large = _ops(512, 512, 128, sinks), _ops(4096, 4096, 128, sinks)
    assert small == large and large[1] == 1 and large[0] <= 80, (small, large)
    # A cached prefix on a sliding layer: the same few ops.
    assert _ops(1000, 4096, 128, sinks)[1] == 1


def test_a_cached_prefix_is_one_bottom_right_causal_call() -> None:
    ops, calls = _ops(45, 4096, None, sinks=True)
    assert calls == 1 and ops <= 40, ops


def test_cuda_allows_only_fused_kernels_and_a_call_none_takes_is_one_clear_error() -> None:
    from torch.nn.attention import SDPBackend

    from disagg_agents.prefill.attention import fused_backends, fused_sdpa

    assert fused_backends("cuda") == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert fused_backends("cpu") is None and fused_backends("mps") is None
    q = torch.randn(1, 2, 8, 16)
    # A CPU has no memory-efficient kernel: restricted to it, SDPA has nothing to run.
    with pytest.raises(RuntimeError, match=r"no fused kernel \(efficient_attention\)") as e:
        fused_sdpa(q, q, q, 0.25, True, is_causal=True, backends=[SDPBackend.EFFICIENT_ATTENTION])
    assert "\n" not in str(e.value)
    out = fused_sdpa(q, q, q, 0.25, True, is_causal=True, backends=[SDPBackend.FLASH_ATTENTION])
    torch.testing.assert_close(out, eager(q, q, q, None, None), atol=2e-6, rtol=1e-5)


def test_tiny_qwen3_on_the_fused_attention_gives_sdpas_greedy_tokens() -> None:
    """transformers' SDPA against this module, generate's decode steps included
    (one query on all the keys: the bottom-right causal path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tinymodels import PROMPT, shared_tiny

    path = shared_tiny("qwen3")
    tok: Any = AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor([tok.encode(PROMPT)])
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    greedy: dict[str, Any] = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        before = model.generate(ids, **greedy)
        use_chunked_attention(model)
        after = model.generate(ids, **greedy)
    assert after.tolist() == before.tolist()


# What only a CUDA machine can check (skipped elsewhere): the fused kernels CUDA
# picks (memory-efficient with a mask, flash for the causal call) give eager's
# result, and the device's own peak memory grows linearly at gpt-oss-120b's shape.
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("q_len", [1000, 300])  # 300: a cached prefix of 700
def test_cuda_equals_eager(dtype: torch.dtype, window: int | None, q_len: int) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 64, q_len, 64, generator=g)
    k = torch.randn(1, 8, 1000, 64, generator=g)
    v = torch.randn(1, 8, 1000, 64, generator=g)
    s = torch.randn(64, generator=g)
    q, k, v, s = (t.to(dtype) for t in (q, k, v, s))  # both sides from the same inputs
    want = eager(q.float(), k.float(), v.float(), window, s.float())  # float32, on the CPU
    got = chunked_attention(q.cuda(), k.cuda(), v.cuda(), 64**-0.5, window, s.cuda())
    got = got.float().cpu()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@cuda
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_peak_memory_linear(window: int | None) -> None:
    def peak(n: int) -> int:
        q = torch.randn(1, 64, n, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        s = torch.randn(64, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        chunked_attention(q, k, v, 64**-0.5, window, s)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    small, large = peak(2048), peak(8192)
    assert large / small <= 4.5, (small, large)
    assert large < 64 * 8192 * 8192 * 2 / 10  # a tenth of eager's bf16 scores

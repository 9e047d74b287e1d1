"""Prefill attention without the n x n matrix, gpt-oss' sinks and sliding window exact.

transformers runs gpt-oss attention eagerly (its SDPA path has no sinks): one
[heads, n, n] score tensor per layer, ~8.6 GB at 8k tokens for gpt-oss-120b in
bf16, so a long prompt does not fit. This module registers `ATTENTION`, a
transformers attention function that calls PyTorch's fused SDPA (flash on CPU,
flash / memory-efficient on CUDA) on chunks of queries:

* the sink: each head's learned logit `s_h` joins the softmax's denominator as
  one extra key that every query sees with value zero. One padded head
  dimension carries it: q gets `s_h / scale` there, the sink key 1, real keys 0,
  so the kernel scores exactly `s_h` for it and the output is eager's exactly.
* causality: a whole prompt on a full layer is one fused causal call (with a
  sink, one dummy query ahead keeps the kernel's top-left causal mask aligned).
* the window, and a prompt whose prefix is cached: queries go in chunks; each
  reads only the keys it may see (a sliding layer: chunk + window - 1 of them)
  with a [chunk, keys] boolean mask, so memory is linear in the prompt.

q, k and v are padded to one head size: fused CPU kernels fall back to the
math path (15x slower here) when v's differs from q's.

Plain torch, so the same code runs on CPU, CUDA and MPS. Batch 1, no padding:
what the prefill engine runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# The name transformers dispatches on; no "sdpa" in it (transformers would check
# that the model supports its own SDPA, which gpt-oss does not).
ATTENTION = "disagg_chunked"
CHUNK = 512  # queries per masked SDPA call: the mask is CHUNK x keys booleans
PAD = 8  # extra head dims carrying the sink; 8 keeps fused kernels' alignment


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Causal attention of the last queries on all keys, as eager computes it.

    Args:
        query: [B, H, q, D]; its positions are the last q of the keys'.
        key, value: [B, Hkv, kv, D], Hkv dividing H (grouped-query attention).
        scale: the softmax scale of q . k.
        window: a sliding layer's window: a query sees itself and the window - 1
            keys before it (transformers' `sliding_window`).
        sinks: [H] logits that join each head's softmax denominator (gpt-oss).
        chunk: queries per fused call where a mask is needed.
    Returns:
        [B, H, q, D].
    """
    q_len, kv_len, d = query.shape[2], key.shape[2], value.shape[3]
    gqa = query.device.type == "cpu"
    if not gqa and key.shape[1] != query.shape[1]:
        # CUDA's memory-efficient kernel (the fused one that takes a mask) may not
        # take grouped heads: expand K/V per query head (linear in the prompt).
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    # A whole prompt on a full layer needs no mask: the fused causal kernel, once.
    # With a sink (key 0), one dummy query ahead keeps causality aligned:
    # query i + 1 sees keys 0..i + 1, the sink and positions 0..i.
    whole = q_len == kv_len and (not window or window >= kv_len)  # short: no window
    lead = 0
    if sinks is not None:
        query, key, value = _with_sink(query, key, value, scale, sinks, dummy=whole)
        lead = 1
    if whole:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out[:, :, lead:, :d]
    if window:
        # A sliding chunk reads chunk + window - 1 keys: short chunks waste less
        # (64 ran 2-5x faster than 512 at window 128 here, CPU).
        chunk = min(chunk, max(32, window // 2))
    return _masked_chunks(query, key, value, scale, window, lead, chunk, gqa)[..., :d]


def _masked_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    lead: int,
    chunk: int,
    gqa: bool,
) -> torch.Tensor:
    """Queries in chunks, each on the keys it may see with a [chunk, keys] mask;
    `lead` sink keys ahead of the real ones are seen by every query."""
    q_len, kv_len = query.shape[2], key.shape[2] - lead
    off = kv_len - q_len  # absolute position of query 0, in key positions
    out = query.new_empty(query.shape[:3] + (value.shape[3],))
    device = query.device
    for a in range(0, q_len, chunk):
        b = min(a + chunk, q_len)
        lo = max(0, off + a - window + 1) if window else 0
        hi = off + b  # keys [lo, hi) are the ones this chunk may see
        qpos = torch.arange(off + a, off + b, device=device)[:, None]
        kpos = torch.arange(lo, hi, device=device)[None, :]
        mask = kpos <= qpos  # [chunk, keys]
        if window:
            mask &= qpos - kpos < window
        if lead and lo > 0:
            idx = slice(lo + lead, hi + lead)
            k_c = torch.cat([key[:, :, :lead], key[:, :, idx]], dim=2)
            v_c = torch.cat([value[:, :, :lead], value[:, :, idx]], dim=2)
        else:  # [sinks, lo = 0, hi): a view, no copy
            k_c, v_c = key[:, :, lo : hi + lead], value[:, :, lo : hi + lead]
        if lead:
            seen = torch.ones(b - a, lead, dtype=torch.bool, device=device)
            mask = torch.cat([seen, mask], dim=1)
        out[:, :, a:b] = F.scaled_dot_product_attention(
            query[:, :, a:b], k_c, v_c, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out


def _with_sink(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    dummy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v padded by PAD head dims (the fused kernels want q, k and v of one
    head size), and a sink key 0 that scores s_h for every query of head h, with
    a zero value. `dummy`: a zero query ahead of the real ones.
    Returns [B, H, dummy + q, D+PAD], [B, Hkv, 1+kv, D+PAD] twice."""
    b, h, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    first = int(dummy)
    q_aug = query.new_zeros(b, h, first + q_len, d + PAD)
    q_aug[:, :, first:, :d] = query
    # q . k_sink * scale = s_h: the sink key is 1 in dim d, so q carries s_h / scale.
    q_aug[:, :, first:, d] = (sinks.to(torch.float32) / scale).to(query.dtype)[None, :, None]
    k_aug = key.new_zeros(b, hkv, 1 + kv_len, d + PAD)
    k_aug[:, :, 1:, :d] = key
    k_aug[:, :, 0, d] = 1
    v_aug = value.new_zeros(b, hkv, 1 + kv_len, d + PAD)
    v_aug[:, :, 1:, : value.shape[3]] = value
    return q_aug, k_aug, v_aug


def attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([B, q, H, D], no weights)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        # Custom implementations get the caller's 2-D mask as is: padding would be lost.
        raise ValueError(f"{ATTENTION} runs unpadded batch-1 prompts only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    out = chunked_attention(query, key, value, scale, sliding_window, sinks)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ATTENTION known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention_forward)
    return ATTENTION


def use_chunked_attention(model: Any) -> None:
    """Switch a loaded transformers model to ATTENTION."""
    model.set_attn_implementation(register())

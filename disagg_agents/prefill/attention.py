"""Prefill attention: fused kernels only, the n x n matrix never, gpt-oss' sinks and
sliding window exact. Every model the prefill engine runs uses it.

transformers runs gpt-oss attention eagerly (its SDPA path has no sinks): one
[heads, n, n] score tensor per layer, ~8.6 GB at 8k tokens for gpt-oss-120b in
bf16. Its SDPA path (Qwen3, Llama) hands a prompt whose prefix is cached a
[q, kv] mask, and nothing stops SDPA's math backend (~135 GB of scores a layer
at 46k tokens). This module registers `ATTENTION`, a transformers attention
function over PyTorch's SDPA, restricted on CUDA to flash / memory-efficient (a
call neither takes is an error, not a math fallback):

* the sink: each head's learned logit `s_h` joins the softmax's denominator as
  one extra key that every query sees with value zero. One padded head
  dimension carries it: q gets `s_h / scale` there, the sink key 1, real keys 0,
  so the kernel scores exactly `s_h` for it and the output is eager's exactly.
* causality: a whole prompt is one fused causal call (with a sink, one dummy
  query ahead keeps the kernel's top-left causal mask aligned); fewer queries
  than keys (a cached prefix) one bottom-right causal call (`causal_lower_right`
  on CUDA: no mask tensor; a CPU builds the mask, in chunks when it is big).
* a sliding window: queries in blocks of one window, each block on its own and
  the previous block's keys, all blocks as one batch of one fused call with one
  [block, 2 blocks] band mask: a few ops per 8k queries, memory linear.

q, k and v are padded to one head size: fused CPU kernels fall back to the
math path (15x slower here) when v's differs from q's.

Plain torch, so the same code runs on CPU, CUDA and MPS. Batch 1, no padding:
what the prefill engine runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The name transformers dispatches on; no "sdpa" in it (transformers would check
# that the model supports its own SDPA, which gpt-oss does not).
ATTENTION = "disagg_chunked"
CHUNK = 512  # queries per masked SDPA call: the mask is CHUNK x keys booleans
MASK_MAX = 1 << 24  # a CPU materializes a bottom-right causal mask up to this size
BAND_QUERIES = 8192  # queries per banded call of a sliding layer (K/V copied 2x per group)
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
        chunk: queries per fused call where a CPU needs a mask for a cached prefix.
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
    sliding = window is not None and 0 < window < kv_len  # one as long as the keys: none
    # A whole prompt needs no mask: the fused causal kernel, once. With a sink (key
    # 0), one dummy query ahead keeps the top-left causal mask aligned.
    whole = q_len == kv_len and not sliding
    lead = 0
    if sinks is not None:
        query, key, value = _with_sink(query, key, value, scale, sinks, dummy=whole)
        lead = 1
    if whole:
        out = fused_sdpa(query, key, value, scale, gqa, is_causal=True)
        return out[:, :, lead:, :d]
    if sliding:
        assert window is not None
        return _banded(query, key, value, scale, window, lead, gqa)[..., :d]
    if query.device.type != "cpu" or q_len * (kv_len + lead) <= MASK_MAX:
        # Fewer queries than keys (a cached prefix): bottom-right aligned causal, a
        # fused kernel on CUDA (flash / memory-efficient), no [q, kv] mask there.
        bias = bottom_right(q_len, kv_len, lead, query.device)
        return fused_sdpa(query, key, value, scale, gqa, attn_mask=bias)[..., :d]
    # A long cached-prefix prefill on a CPU: [chunk, keys] masks, memory linear.
    return _masked_chunks(query, key, value, scale, None, lead, chunk, gqa)[..., :d]


def bottom_right(q_len: int, kv_len: int, lead: int, device: torch.device) -> Any:
    """Causal attention of the last q_len positions on kv_len keys (after `lead`
    sink keys every query sees). On CUDA torch's `causal_lower_right`, which runs
    flash / memory-efficient with no mask tensor; elsewhere SDPA would build the
    [q, kv] mask anyway, so it is built here (as under a dispatch mode, where the
    CausalBias subclass cannot be made)."""
    if device.type == "cuda":
        try:
            # Imported here: the module pulls in torch._dynamo and with it triton
            # (~0.7 s), which a CPU prefill never needs.
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(q_len, kv_len + lead)
        except RuntimeError:
            pass
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    mask = torch.arange(kv_len, device=device)[None, :] <= qpos
    return F.pad(mask, (lead, 0), value=True) if lead else mask


def fused_backends(device_type: str) -> list[SDPBackend] | None:
    """The SDPA backends attention may use on a device: on CUDA only the fused ones
    (the math backend holds [heads, q, kv] scores: ~135 GB a layer at 46k tokens);
    elsewhere whatever SDPA picks (None)."""
    if device_type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return None


def fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    gqa: bool,
    attn_mask: Any = None,
    is_causal: bool = False,
    backends: list[SDPBackend] | None = None,
) -> torch.Tensor:
    """F.scaled_dot_product_attention within the device's allowed backends; a call
    no allowed kernel takes is one clear error, not a fall back to the math path."""
    allowed = backends if backends is not None else fused_backends(query.device.type)
    if allowed is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=gqa,
        )  # fmt: skip
    try:
        with sdpa_kernel(allowed):
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                enable_gqa=gqa,
            )  # fmt: skip
    except RuntimeError as e:
        names = ", ".join(b.name.lower() for b in allowed)
        shape = f"q {tuple(query.shape)} {query.dtype}, kv {tuple(key.shape)}"
        raise RuntimeError(
            f"attention on {query.device.type}: no fused kernel ({names}) takes {shape}; "
            f"the math fallback would hold every score: {str(e).splitlines()[0]}"
        ) from None


def _banded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int,
    lead: int,
    gqa: bool,
) -> torch.Tensor:
    """A sliding layer as bands: queries in blocks of `window`, each block on its own
    and the previous block's keys (all a query may see), the blocks of a group as one
    batch of one fused call. A few ops per BAND_QUERIES queries, not per 64; `lead`
    sink keys ahead of the real ones are seen by every query."""
    b, h, q_len, dp = query.shape
    kv_len = key.shape[2] - lead
    off = kv_len - q_len  # absolute position of query 0
    c = window
    nb = -(-q_len // c)
    qpad = nb * c - q_len
    # Keys padded by a block ahead (positions < 0) and behind (the last block's pad).
    kp = F.pad(key[:, :, lead:], (0, 0, c, c + qpad))
    vp = F.pad(value[:, :, lead:], (0, 0, c, c + qpad))
    qp = F.pad(query, (0, 0, 0, qpad)) if qpad else query
    i = torch.arange(c, device=query.device)[:, None]
    t = torch.arange(2 * c, device=query.device)[None, :]
    band = (t > i) & (t <= c + i)  # key t of [previous block, own block] for query i
    out = query.new_empty(b, h, nb * c, value.shape[3])
    per = max(1, BAND_QUERIES // c)
    for g0 in range(0, nb, per):
        g1 = min(nb, g0 + per)
        n = g1 - g0
        # Block j reads padded keys [off + j*c, off + (j+2)*c): a strided window.
        ks = _blocks(kp[:, :, off + g0 * c : off + (g1 + 1) * c], c, key[:, :, :lead])
        vs = _blocks(vp[:, :, off + g0 * c : off + (g1 + 1) * c], c, value[:, :, :lead])
        qs = qp[:, :, g0 * c : g1 * c].reshape(b, h, n, c, dp).transpose(1, 2)
        first = off + (torch.arange(g0, g1, device=query.device)[:, None] - 1) * c
        mask = band & (first + t >= 0)[:, None, :]  # [n, c, 2c]: no position < 0
        if lead:
            mask = F.pad(mask, (lead, 0), value=True)
        y = fused_sdpa(
            qs.reshape(b * n, h, c, dp), ks, vs, scale, gqa,
            attn_mask=mask.repeat(b, 1, 1).unsqueeze(1),
        )  # fmt: skip
        out[:, :, g0 * c : g1 * c] = y.view(b, n, h, c, -1).transpose(1, 2).reshape(b, h, n * c, -1)
    return out[:, :, :q_len]


def _blocks(x: torch.Tensor, c: int, sink: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, (n+1)*c, D] -> [B*n, Hkv, lead + 2c, D]: block j holds rows
    j*c..(j+2)*c, after the `sink` rows [B, Hkv, lead, D]."""
    b, hkv, _, d = x.shape
    w = x.unfold(2, 2 * c, c).transpose(-1, -2)  # [B, Hkv, n, 2c, D]
    n = w.shape[2]
    w = w.transpose(1, 2)  # [B, n, Hkv, 2c, D]
    if sink.shape[2]:
        w = torch.cat([sink.unsqueeze(1).expand(b, n, hkv, -1, d), w], dim=3)
    return w.reshape(b * n, hkv, -1, d)


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
        out[:, :, a:b] = fused_sdpa(query[:, :, a:b], k_c, v_c, scale, gqa, attn_mask=mask)
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
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{ATTENTION} computes causal attention only")
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

"""Place K/V that transformers computed into mlx-lm's cache objects."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from disagg_agents.wire.kvcodec import DType, LayerKV

MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def to_mx(a: np.ndarray, dtype: DType) -> mx.array:
    """[H, S, D] wire array -> [1, H, S, D] mx array, bit for bit."""
    arr = mx.array(a[None])
    return arr.view(mx.bfloat16) if dtype == DType.BFLOAT16 else arr


def cache_kinds(caches: list[Any]) -> list[list[Any]]:
    """Per layer [kind, window] as mlx-lm will cache it (compare: layer_kinds_from_hf)."""
    out: list[list[Any]] = []
    for c in caches:
        if isinstance(c, RotatingKVCache):
            out.append(["sliding", int(c.max_size)])
        elif isinstance(c, KVCache):
            out.append(["full", 0])
        else:
            out.append([type(c).__name__, 0])
    return out


def check_layer(cache: Any, kv: LayerKV, prompt_len: int) -> None:
    """Raise ValueError unless `kv` can fill `cache` for a prompt of `prompt_len`
    (numpy only: safe on any thread)."""
    kept = kv.keys.shape[1]
    if isinstance(cache, RotatingKVCache):
        if kept > prompt_len or kept > cache.max_size:
            raise ValueError(f"layer {kv.layer}: sliding layer sent {kept} of {prompt_len} tokens")
    elif isinstance(cache, KVCache):
        if kept != prompt_len:
            raise ValueError(
                f"layer {kv.layer}: full-attention layer sent {kept} of {prompt_len} tokens"
            )
    else:
        raise ValueError(f"layer {kv.layer}: cannot fill an mlx {type(cache).__name__}")


def fill_layer(cache: Any, kv: LayerKV, prompt_len: int) -> None:
    """Make `cache` look as if mlx itself had just prefilled `prompt_len` tokens
    (after check_layer; mlx work: on the mlx thread).

    transformers keeps the last window-1 tokens of a sliding layer; mlx's
    RotatingKVCache then needs a buffer of max_size with the write index
    on the free slot, or its next in-place update breaks.
    """
    check_layer(cache, kv, prompt_len)
    keys, values = to_mx(kv.keys, kv.dtype), to_mx(kv.values, kv.dtype)
    kept = keys.shape[2]
    if isinstance(cache, RotatingKVCache):
        if kept < prompt_len and kept < cache.max_size:
            pad = cache.max_size - kept
            zk = mx.zeros((*keys.shape[:2], pad, keys.shape[3]), keys.dtype)
            zv = mx.zeros((*values.shape[:2], pad, values.shape[3]), values.dtype)
            keys, values = mx.concatenate([keys, zk], axis=2), mx.concatenate([values, zv], axis=2)
        cache.keys, cache.values = keys, values
        cache.offset, cache._idx = prompt_len, kept
    else:
        # Leave room for decoding, as mlx-lm's own prefill does: the first step
        # then writes in place instead of copying the whole cache to grow it.
        capacity = (prompt_len // cache.step + 1) * cache.step
        cache.keys = mx.zeros((*keys.shape[:2], capacity, keys.shape[3]), keys.dtype)
        cache.values = mx.zeros((*values.shape[:2], capacity, values.shape[3]), values.dtype)
        cache.keys[..., :prompt_len, :] = keys
        cache.values[..., :prompt_len, :] = values
        cache.offset = prompt_len
    mx.eval(cache.keys, cache.values)

"""MXFP4 through the per-device byte table, computed in the target dtype: bit for bit
what mlx dequantizes, for every byte and every E8M0 scale (the subnormal 2^-127,
scales far outside fp16's range, the largest ones)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from disagg_agents.quant.dequant import Packed, QSpec
from tests.test_quant_units import DTYPES, same_bits, to_torch


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_byte_at_every_scale_matches_mx(dtype: str) -> None:
    mxt, tt = DTYPES[dtype]
    scales = np.arange(255, dtype=np.uint8)[:, None]  # one group of 32 per row
    blocks = np.tile(np.arange(256, dtype=np.uint8)[:16], (255, 1))  # bytes 0..15
    blocks = np.concatenate([blocks + 16 * k for k in range(16)], axis=0)  # all 256
    scales = np.concatenate([scales] * 16, axis=0)
    words = blocks.view(np.uint32)  # mlx keeps the bytes as uint32 words
    ref = mx.dequantize(
        mx.array(words), mx.array(scales), None, group_size=32, bits=4, mode="mxfp4", dtype=mxt
    )
    p = Packed(
        torch.from_numpy(blocks), torch.from_numpy(scales), None, QSpec("mxfp4", 4, 32), 32, tt
    )
    ours, theirs = p.full(), to_torch(ref)
    nan = theirs.isnan()  # fp16: 0 x an overflowed scale; NaN payloads differ
    assert torch.equal(ours.isnan(), nan)
    assert same_bits(ours[~nan], theirs[~nan])

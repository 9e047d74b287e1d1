"""KV layers through the codec: every dtype bit-exact, every codec, bad bytes refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents import kvcodec as K
from agents.prefill import to_wire
from agents.protocol import ProtocolError


def join(bufs: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(b) for b in bufs)


def torch_kv(dtype: torch.dtype, seq: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, seq, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, seq, 32, generator=g).to(dtype) * 1e-3  # small values: subnormals in fp16
    return k, v


@pytest.mark.parametrize(
    "dtype, wire",
    [
        (torch.float32, K.DType.FLOAT32),
        (torch.float16, K.DType.FLOAT16),
        (torch.bfloat16, K.DType.BFLOAT16),
    ],
)
@pytest.mark.parametrize("codec", list(K.Codec))
def test_round_trip_is_bit_exact(dtype: torch.dtype, wire: K.DType, codec: K.Codec) -> None:
    k, v = torch_kv(dtype)
    kv = K.LayerKV(5, K.Kind.SLIDING, wire, to_wire(k), to_wire(v))
    back = K.decode_layer(join(K.encode_layer(kv, codec)))
    assert (back.layer, back.kind, back.dtype) == (5, K.Kind.SLIDING, wire)
    # Compare the raw 16/32-bit words: equal values are not enough, the bits must be.
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for sent, got in ((k, back.keys), (v, back.values)):
        assert got.shape == tuple(sent.shape[1:])
        assert torch.equal(torch.from_numpy(got.copy()).view(bits), sent[0].contiguous().view(bits))


def test_bf16_bits_survive_into_mlx() -> None:
    import mlx.core as mx

    from agents.mlxcache import to_mx

    k, _ = torch_kv(torch.bfloat16)
    kv = K.decode_layer(
        join(K.encode_layer(K.LayerKV(0, K.Kind.FULL, K.DType.BFLOAT16, to_wire(k), to_wire(k))))
    )
    arr = to_mx(kv.keys, kv.dtype)
    assert arr.dtype == mx.bfloat16
    words = np.array(arr.view(mx.uint16))[0]
    assert np.array_equal(words, k[0].view(torch.int16).numpy().view(np.uint16))


def test_shuffle_zstd_compresses_real_looking_kv() -> None:
    k, v = torch_kv(torch.bfloat16, seq=512)
    kv = K.LayerKV(0, K.Kind.FULL, K.DType.BFLOAT16, to_wire(k), to_wire(v))
    raw = len(join(K.encode_layer(kv, K.Codec.RAW)))
    shuffled = len(join(K.encode_layer(kv, K.Codec.SHUFFLE_ZSTD)))
    assert shuffled < raw


def test_wrong_dtype_is_refused_at_encode() -> None:
    a = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="wire is FLOAT16"):
        K.encode_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT16, a, a))


@pytest.mark.parametrize("codec", list(K.Codec))
def test_corrupt_frames_raise_protocol_error(codec: K.Codec) -> None:
    a = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
    good = join(K.encode_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, a, a), codec))
    head = bytearray(good[: K.LAYER_HEADER.size])
    with pytest.raises(ProtocolError):
        K.decode_layer(good[:-1])  # truncated
    with pytest.raises(ProtocolError):
        K.decode_layer(good[:10])  # shorter than the header
    fields = list(K.LAYER_HEADER.unpack(head))
    fields[5] = 1 << 30  # claims a huge sequence: must not allocate it
    with pytest.raises(ProtocolError):
        K.decode_layer(K.LAYER_HEADER.pack(*fields) + good[K.LAYER_HEADER.size :])
    fields = list(K.LAYER_HEADER.unpack(head))
    fields[2] = 77  # unknown dtype
    with pytest.raises(ProtocolError, match="KV_LAYER"):
        K.decode_layer(K.LAYER_HEADER.pack(*fields) + good[K.LAYER_HEADER.size :])

"""KV layers through the codec: every dtype bit-exact, every codec, bad bytes refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg_agents.prefill.engine import to_wire
from disagg_agents.wire import kvcodec as K
from disagg_agents.wire.frames import ProtocolError


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

    from disagg_agents.decode.kvcaches import to_mx

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


# -- lossy int8 (kv_quant "int8") ---------------------------------------------


def test_check_quant_names_the_allowed_values() -> None:
    assert K.check_quant(None) is None and K.check_quant("none") is None
    assert K.check_quant("int8") == "int8"
    for bad in ("int4", "INT8", "", 8, True):
        with pytest.raises(ValueError, match="use 'int8'"):
            K.check_quant(bad)


WIRES = [
    (torch.float32, K.DType.FLOAT32),
    (torch.float16, K.DType.FLOAT16),
    (torch.bfloat16, K.DType.BFLOAT16),
]


def int8_frame(kv: K.LayerKV, codec: K.Codec = K.Codec.RAW) -> bytes:
    return join(K.encode_layer(K.quantize_layer(kv), codec))


def half_ulp(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Half a unit in the last place of |x| in `dtype`: its own rounding error."""
    mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    tiny = float(torch.finfo(dtype).smallest_normal) * 2.0**-mant  # subnormal spacing
    exp = np.floor(np.log2(np.maximum(np.abs(x), 1e-38)))
    return np.maximum(2.0 ** (exp - mant), tiny) / 2


@pytest.mark.parametrize("dtype, wire", WIRES)
@pytest.mark.parametrize("codec", list(K.Codec))
def test_int8_round_trip_within_half_a_step(
    dtype: torch.dtype, wire: K.DType, codec: K.Codec
) -> None:
    k, v = torch_kv(dtype)
    kv = K.LayerKV(5, K.Kind.SLIDING, wire, to_wire(k), to_wire(v))
    back = K.decode_layer(int8_frame(kv, codec))
    assert (back.layer, back.kind, back.dtype, back.quant) == (5, K.Kind.SLIDING, wire, "int8")
    for sent, got in ((k[0].float().numpy(), back.keys), (v[0].float().numpy(), back.values)):
        assert got.shape == sent.shape and got.dtype == K.WIRE_NUMPY[wire]
        step = np.abs(sent).max(axis=-1, keepdims=True) / K.QMAX  # one step per row
        err = np.abs(K.to_float32(got, wire) - sent)
        # Half a step, float32 slack, then the wire dtype's own rounding of the result.
        assert (err <= step / 2 * (1 + 1e-5) + half_ulp(np.abs(sent) + step, dtype)).all()
        # That rounding is torch's (bf16: our bit shifting must match it exactly).
        q, scale = K.quantize_rows(K.from_float32(sent, wire), wire)
        want = torch.from_numpy(q.astype(np.float32) * scale[..., None]).to(dtype)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(torch.from_numpy(got.copy()).view(bits), want.view(bits))


def test_int8_zero_rows_and_empty_layers() -> None:
    a = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    a[0, 2] = 0.0  # an all-zero row: scale 0, not a division by zero
    a[1, 4] = -0.0
    a[1, 3] = 1e-40  # subnormal: 1 / (1e-40 / 127) is not a float32, so sent as zeros
    back = K.decode_layer(int8_frame(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, a, a)))
    assert not back.keys[0, 2].any() and not back.keys[1, 4].any() and not back.keys[1, 3].any()
    assert np.isfinite(back.keys).all()
    q, scale = K.quantize_rows(a, K.DType.FLOAT32)
    assert scale[0, 2] == 0 and not q[0, 2].any()
    for shape in ((3, 0, 64), (0, 4, 64), (3, 4, 0)):  # no tokens, no heads, no dims
        e = np.zeros(shape, np.float16)
        for codec in K.Codec:
            got = K.decode_layer(
                int8_frame(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT16, e, e), codec)
            )
            assert got.keys.shape == shape and got.keys.dtype == np.float16


def test_int8_non_finite_values_saturate_not_poison() -> None:
    a = np.ones((1, 2, 4), np.float32)
    a[0, 0, 1], a[0, 1, 2] = np.nan, -np.inf
    q, scale = K.quantize_rows(a, K.DType.FLOAT32)
    assert np.isfinite(scale).all()
    assert q[0, 0].tolist() == [127, 0, 127, 127]  # NaN -> 0; the rest of the row kept


def test_int8_shrinks_the_frame() -> None:
    k, v = torch_kv(torch.float32, seq=256)
    kv = K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, to_wire(k), to_wire(v))
    lossless, lossy = join(K.encode_layer(kv)), int8_frame(kv)
    q = K.quantize_layer(kv)
    # 1 byte per element + one float32 scale per row of K and of V.
    assert (
        len(lossy) - K.LAYER_HEADER.size
        == K.block_bytes(q)
        == q.keys.size + q.values.size + 2 * 3 * 256 * 4
    )
    assert len(lossless) / len(lossy) > 3.5
    assert K.block_bytes(K.decode_layer(lossy)) == K.block_bytes(q)


def test_int8_encode_refuses_inconsistent_blocks() -> None:
    k, _ = torch_kv(torch.float32)
    q = K.quantize_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, to_wire(k), to_wire(k)))
    q.k_scale = q.k_scale[:, :-1]
    with pytest.raises(ValueError, match="row scales"):
        K.encode_layer(q)


# LAYER_HEADER's fields, in order.
HEADER_FIELDS = (
    "layer",
    "kind",
    "dtype",
    "codec",
    "base",
    "heads",
    "seq",
    "k_dim",
    "v_dim",
    "k_len",
    "v_len",
)


def with_fields(frame: bytes, **changes: int) -> bytes:
    fields = dict(zip(HEADER_FIELDS, K.LAYER_HEADER.unpack_from(frame), strict=True))
    fields.update(changes)
    return K.LAYER_HEADER.pack(*fields.values()) + frame[K.LAYER_HEADER.size :]


def refused(frame: bytes) -> bool:
    try:
        K.decode_layer(frame)
    except ProtocolError:
        return True
    return False


@pytest.mark.parametrize("codec", list(K.Codec))
def test_int8_hostile_frames_raise_protocol_error(codec: K.Codec) -> None:
    a = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
    kv = K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, a, a)
    good = int8_frame(kv, codec)
    assert np.allclose(K.decode_layer(good).keys, a, atol=a.max() / 254 + 1e-5)
    bad = {
        "truncated": good[:-1],
        "header only": good[:10],
        "huge sequence": with_fields(good, seq=1 << 30),
        "no base dtype": with_fields(good, base=0),
        "unknown base dtype": with_fields(good, base=int(K.DType.INT8)),
        "block lengths": with_fields(good, k_len=1, v_len=len(good) - K.LAYER_HEADER.size - 1),
        "wider rows": with_fields(good, k_dim=5),
    }
    assert [why for why, frame in bad.items() if not refused(frame)] == []
    # The cap covers what the frame dequantizes to, not just the int8 it carries.
    out_bytes = a.nbytes * 2
    K.decode_layer(good, max_bytes=out_bytes)
    with pytest.raises(ProtocolError, match="over the cap"):
        K.decode_layer(good, max_bytes=out_bytes - 1)


@pytest.mark.parametrize("scale", [-1.0, np.nan, np.inf])
def test_int8_bad_scales_are_refused(scale: float) -> None:
    a = np.ones((1, 3, 4), np.float32)
    q = K.quantize_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, a, a))
    q.v_scale[0, 1] = scale
    with pytest.raises(ProtocolError, match="row scale"):
        K.decode_layer(join(K.encode_layer(q)))


def test_lossless_frames_keep_base_zero() -> None:
    a = np.zeros((1, 2, 4), np.float32)
    good = join(K.encode_layer(K.LayerKV(0, K.Kind.FULL, K.DType.FLOAT32, a, a)))
    assert K.LAYER_HEADER.unpack_from(good)[4] == 0
    assert K.decode_layer(good).quant is None
    with pytest.raises(ProtocolError, match="base dtype"):
        K.decode_layer(with_fields(good, base=int(K.DType.FLOAT16)))

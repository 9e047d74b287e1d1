"""One layer of K/V <-> the bytes of a KV_LAYER frame.

Tensors arrive here as numpy arrays in their wire dtype: float32, float16, or
uint16 words for bfloat16 (numpy has no bfloat16; we never round-trip it
through float32). Optional byte-shuffle + zstd; raw bytes are sent as views.

Optional lossy int8 (`quantize_layer`): each [head, token] row of K and of V
becomes int8 with one float32 scale (symmetric absmax over the row). Such a
frame has dtype INT8 and names the model's dtype in the header's `base` byte;
each K or V block is the row scales [heads, seq] float32, then the int8 rows
[heads, seq, dim], and the codec compresses that block as it would any other.
`decode_layer` dequantizes back to the model's dtype, so a receiver gets the
same LayerKV either way. Lossless frames carry base 0.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zstandard

from disagg_agents.wire.frames import DEFAULT_MAX_FRAME, ProtocolError
from disagg_agents.wire.request import check_kv_quant as check_quant  # noqa: F401  (one check, re-exported)

# layer, kind, dtype, codec, base, heads, seq, k_dim, v_dim, k_len, v_len
# (base was a pad byte, always 0: old lossless frames parse unchanged)
LAYER_HEADER = struct.Struct("<IBBBBIIIIQQ")


class DType(enum.IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT8 = 4  # int8 rows + float32 row scales; `base` is the dtype to restore


class Codec(enum.IntEnum):
    RAW = 0
    ZSTD = 1
    SHUFFLE_ZSTD = 2


class Kind(enum.IntEnum):
    FULL = 0
    SLIDING = 1


WIRE_NUMPY = {DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16}
DTYPE_NAMES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}
QMAX = 127  # symmetric: -127..127, so -x quantizes to -q
SCALE_DTYPE = np.dtype(np.float32)


@dataclass
class LayerKV:
    layer: int
    kind: Kind
    dtype: DType
    keys: np.ndarray  # [heads, seq, k_dim] in the wire dtype
    values: np.ndarray  # [heads, seq, v_dim]
    quant: str | None = None  # how it travelled: None lossless, "int8" dequantized
    # Set while a device-to-host copy into keys/values may still be running.
    ready: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def wait(self) -> None:
        """Block until keys and values hold their bytes (see `ready`)."""
        if self.ready is not None:
            self.ready()
            self.ready = None


@dataclass
class QuantKV:
    """One layer as int8 rows, each with its float32 scale (row absmax / 127)."""

    layer: int
    kind: Kind
    dtype: DType  # the model's wire dtype, which decode_layer restores
    keys: np.ndarray  # [heads, seq, k_dim] int8
    values: np.ndarray  # [heads, seq, v_dim] int8
    k_scale: np.ndarray  # [heads, seq] float32
    v_scale: np.ndarray  # [heads, seq] float32


def to_float32(a: np.ndarray, dtype: DType) -> np.ndarray:
    """Wire array -> float32 values (bf16 words: the high half of a float32)."""
    if dtype == DType.BFLOAT16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def from_float32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values -> wire array, rounded to nearest even as torch rounds."""
    if dtype == DType.BFLOAT16:
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        # bf16 has no native numpy dtype: round the low 16 bits away by hand.
        return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return x.astype(WIRE_NUMPY[dtype], copy=False)


def quantize_rows(a: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """[heads, seq, dim] wire array -> (int8 [heads, seq, dim], scales [heads, seq]).

    Every value is within half a step (its row's scale / 2) of q * scale. A row
    of zeros, or of values all below ~1e-36 (float32 subnormals, whose scale
    would have no finite inverse), gets scale 0 and comes back as zeros.
    """
    x = to_float32(a, dtype)
    absmax = np.abs(x).max(axis=-1, initial=0.0)
    if not np.isfinite(absmax).all():
        # NaN / inf would poison the whole row's scale: saturate them instead.
        x = np.nan_to_num(x)  # NaN -> 0, inf -> the float32 extremes
        absmax = np.abs(x).max(axis=-1, initial=0.0)
    scale = (absmax / QMAX).astype(np.float32)
    scale[scale < np.finfo(np.float32).tiny] = 0.0
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint(x * inv[..., None]), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray, dtype: DType) -> np.ndarray:
    """Inverse of quantize_rows, in the wire dtype `dtype`."""
    return from_float32(q.astype(np.float32) * scale[..., None], dtype)


def quantize_layer(kv: LayerKV) -> QuantKV:
    kq, ks = quantize_rows(kv.keys, kv.dtype)
    vq, vs = quantize_rows(kv.values, kv.dtype)
    return QuantKV(kv.layer, kv.kind, kv.dtype, kq, vq, ks, vs)


def block_bytes(kv: LayerKV | QuantKV) -> int:
    """K + V bytes as the codec sees them: after quantization, before compression."""
    if isinstance(kv, QuantKV) or kv.quant is not None:
        rows = kv.keys.shape[0] * kv.keys.shape[1]
        return kv.keys.size + kv.values.size + 2 * rows * SCALE_DTYPE.itemsize
    return int(kv.keys.nbytes + kv.values.nbytes)


def _shuffle(a: np.ndarray) -> bytes:
    # Group byte i of every element together: exponents compress, mantissas don't.
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).tobytes()


def _unshuffle(raw: bytes | memoryview, itemsize: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(itemsize, -1).T.tobytes()


def _compress(block: list[np.ndarray], codec: Codec, level: int) -> list[bytes | memoryview]:
    """One K or V block (its arrays back to back) as buffers to send."""
    if codec == Codec.RAW:
        # Flat byte views, not copies; cast is a third of reshape + view's time
        # per layer, but refuses an empty array (which has no bytes to send).
        return [
            memoryview(np.ascontiguousarray(a)).cast("B")  # type: ignore[arg-type]
            if a.size
            else memoryview(b"")
            for a in block
        ]
    shuffle = codec == Codec.SHUFFLE_ZSTD
    raw = b"".join(_shuffle(a) if shuffle else np.ascontiguousarray(a).tobytes() for a in block)
    return [zstandard.ZstdCompressor(level=level).compress(raw)]


def _nbytes(bufs: list[bytes | memoryview]) -> int:
    return sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in bufs)


def encode_layer(
    kv: LayerKV | QuantKV, codec: Codec = Codec.RAW, level: int = 1
) -> list[bytes | memoryview]:
    """Return the KV_LAYER payload as buffers to hand to `send_frame` as is."""
    k, v = kv.keys, kv.values
    if isinstance(kv, QuantKV):
        wire, base = DType.INT8, int(kv.dtype)
        ok = k.dtype == v.dtype == np.int8 and kv.k_scale.dtype == kv.v_scale.dtype == SCALE_DTYPE
        ok = ok and kv.k_scale.shape == k.shape[:2] == v.shape[:2] == kv.v_scale.shape
        if not ok or kv.dtype not in WIRE_NUMPY:
            raise ValueError(f"layer {kv.layer}: not int8 rows with float32 row scales")
        k_block, v_block = [kv.k_scale, k], [kv.v_scale, v]
    else:
        wire, base = kv.dtype, 0
        if kv.dtype not in WIRE_NUMPY or k.dtype != WIRE_NUMPY[kv.dtype] or v.dtype != k.dtype:
            raise ValueError(
                f"layer {kv.layer}: arrays are {k.dtype}/{v.dtype}, wire is {kv.dtype.name}"
            )
        k_block, v_block = [k], [v]
    heads, seq, k_dim = k.shape
    v_dim = v.shape[2]
    kb, vb = _compress(k_block, codec, level), _compress(v_block, codec, level)
    head = LAYER_HEADER.pack(
        kv.layer, kv.kind, wire, codec, base, heads, seq, k_dim, v_dim, _nbytes(kb), _nbytes(vb)
    )
    return [head, *kb, *vb]


def expand_block(raw: memoryview, codec: Codec, nbytes: int) -> bytes | memoryview:
    """A block as sent -> its `nbytes` bytes (still shuffled, for SHUFFLE_ZSTD)."""
    if codec == Codec.RAW:
        if len(raw) != nbytes:
            raise ProtocolError(f"raw K/V block is {len(raw)} bytes, shape says {nbytes}")
        return raw
    try:
        # python-zstandard allocates what a frame declares and ignores
        # max_output_size then: compare the declaration with the shape first.
        declared = zstandard.frame_content_size(raw)
        if declared not in (-1, nbytes):
            raise ProtocolError(f"zstd block declares {declared} bytes, shape says {nbytes}")
        out = zstandard.ZstdDecompressor().decompress(raw, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise ProtocolError(f"bad zstd block: {e}") from None
    if len(out) != nbytes:
        raise ProtocolError(f"zstd block expands to {len(out)} bytes, shape says {nbytes}")
    return out


def as_array(
    raw: bytes | memoryview, codec: Codec, dtype: np.dtype, shape: tuple[int, ...]
) -> np.ndarray:
    """An expanded block as a numpy array of `shape` (unshuffled first where it was)."""
    if codec == Codec.SHUFFLE_ZSTD:
        raw = _unshuffle(raw, dtype.itemsize)
    return np.frombuffer(raw, dtype).reshape(shape)


def _dequant_block(
    raw: bytes | memoryview, codec: Codec, heads: int, seq: int, dim: int, base: DType
) -> np.ndarray:
    split = heads * seq * SCALE_DTYPE.itemsize
    scale = as_array(memoryview(raw)[:split], codec, SCALE_DTYPE, (heads, seq))
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise ProtocolError("KV_LAYER int8 block has a negative or non-finite row scale")
    q = np.frombuffer(memoryview(raw)[split:], np.int8).reshape(heads, seq, dim)
    return dequantize_rows(q, scale, base)


def decode_layer(
    payload: bytearray | bytes | memoryview, max_bytes: int = DEFAULT_MAX_FRAME
) -> LayerKV:
    """Parse a KV_LAYER payload; raises ProtocolError on anything inconsistent.

    `max_bytes` caps what the layer may expand to (its blocks decompressed, and
    its arrays dequantized), so a small frame that claims a huge shape cannot
    make us allocate it; a receiver passes what the layer's expected shape
    needs. An int8 frame comes back in its model dtype. Whatever goes wrong
    (MemoryError included) is a ProtocolError, so the receiver can fall back.
    """
    try:
        return _decode_layer(payload, max_bytes)
    except ProtocolError:
        raise
    except (ValueError, MemoryError, OverflowError, zstandard.ZstdError) as e:
        raise ProtocolError(f"bad KV_LAYER frame: {type(e).__name__}: {e}") from None


def layer_cap(heads: int, seq: int, head_dim: int) -> int:
    """Most bytes one layer of `heads` x `seq` x `head_dim` may expand to in
    decode_layer, whatever its dtype (float32 is the widest) or quantization."""
    return 2 * heads * seq * (head_dim * 4 + SCALE_DTYPE.itemsize)


def _decode_layer(payload: bytearray | bytes | memoryview, max_bytes: int) -> LayerKV:
    if len(payload) < LAYER_HEADER.size:
        raise ProtocolError("KV_LAYER frame shorter than its header")
    fields = LAYER_HEADER.unpack_from(payload)
    layer, kind, dtype, codec, base, heads, seq, k_dim, v_dim, k_len, v_len = fields
    try:
        kind_e, dtype_e, codec_e = Kind(kind), DType(dtype), Codec(codec)
    except ValueError as e:
        raise ProtocolError(f"KV_LAYER: {e}") from None
    quant = dtype_e == DType.INT8
    if quant and base not in {int(d) for d in WIRE_NUMPY}:
        raise ProtocolError(f"KV_LAYER: int8 frame restores to unknown dtype {base}")
    if not quant and base != 0:
        raise ProtocolError(f"KV_LAYER: lossless frame with base dtype {base}, must be 0")
    if LAYER_HEADER.size + k_len + v_len != len(payload):
        raise ProtocolError("KV_LAYER block lengths do not add up to the frame length")
    out_dtype = DType(base) if quant else dtype_e
    itemsize = np.dtype(WIRE_NUMPY[out_dtype]).itemsize
    rows = heads * seq
    if quant:
        k_bytes = rows * (SCALE_DTYPE.itemsize + k_dim)
        v_bytes = rows * (SCALE_DTYPE.itemsize + v_dim)
    else:
        k_bytes, v_bytes = rows * k_dim * itemsize, rows * v_dim * itemsize
    expanded = max(k_bytes + v_bytes, rows * (k_dim + v_dim) * itemsize)
    if expanded > max_bytes:
        raise ProtocolError(f"KV_LAYER claims {expanded} bytes, over the cap of {max_bytes}")
    view = memoryview(payload)[LAYER_HEADER.size :]
    k_raw = expand_block(view[:k_len], codec_e, k_bytes)
    v_raw = expand_block(view[k_len:], codec_e, v_bytes)
    if quant:
        keys = _dequant_block(k_raw, codec_e, heads, seq, k_dim, out_dtype)
        values = _dequant_block(v_raw, codec_e, heads, seq, v_dim, out_dtype)
        return LayerKV(layer, kind_e, out_dtype, keys, values, "int8")
    np_dtype = np.dtype(WIRE_NUMPY[out_dtype])
    keys = as_array(k_raw, codec_e, np_dtype, (heads, seq, k_dim))
    values = as_array(v_raw, codec_e, np_dtype, (heads, seq, v_dim))
    return LayerKV(layer, kind_e, out_dtype, keys, values)

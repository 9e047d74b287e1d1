"""One layer of K/V <-> the bytes of a KV_LAYER frame.

Tensors arrive here as numpy arrays in their wire dtype: float32, float16, or
uint16 words for bfloat16 (numpy has no bfloat16; we never round-trip it
through float32). Optional byte-shuffle + zstd; raw bytes are sent as views.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from .protocol import DEFAULT_MAX_FRAME, ProtocolError

# layer, kind, dtype, codec, heads, seq, k_dim, v_dim, k_len, v_len
LAYER_HEADER = struct.Struct("<IBBBxIIIIQQ")


class DType(enum.IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3


class Codec(enum.IntEnum):
    RAW = 0
    ZSTD = 1
    SHUFFLE_ZSTD = 2


class Kind(enum.IntEnum):
    FULL = 0
    SLIDING = 1


WIRE_NUMPY = {DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16}
DTYPE_NAMES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}


@dataclass
class LayerKV:
    layer: int
    kind: Kind
    dtype: DType
    keys: np.ndarray  # [heads, seq, k_dim] in the wire dtype
    values: np.ndarray  # [heads, seq, v_dim]


def _shuffle(a: np.ndarray) -> bytes:
    # Group byte i of every element together: exponents compress, mantissas don't.
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).tobytes()


def _unshuffle(raw: bytes, itemsize: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(itemsize, -1).T.tobytes()


def _compress(a: np.ndarray, codec: Codec, level: int) -> bytes | memoryview:
    if codec == Codec.RAW:
        return memoryview(np.ascontiguousarray(a)).cast("B")  # type: ignore[arg-type]
    raw = _shuffle(a) if codec == Codec.SHUFFLE_ZSTD else np.ascontiguousarray(a).tobytes()
    return zstandard.ZstdCompressor(level=level).compress(raw)


def encode_layer(kv: LayerKV, codec: Codec = Codec.RAW, level: int = 1) -> list[bytes | memoryview]:
    """Return the KV_LAYER payload as buffers to hand to `send_frame` as is."""
    k, v = kv.keys, kv.values
    if k.dtype != WIRE_NUMPY[kv.dtype] or v.dtype != k.dtype:
        raise ValueError(
            f"layer {kv.layer}: arrays are {k.dtype}/{v.dtype}, wire is {kv.dtype.name}"
        )
    heads, seq, k_dim = k.shape
    v_dim = v.shape[2]
    kb, vb = _compress(k, codec, level), _compress(v, codec, level)
    head = LAYER_HEADER.pack(
        kv.layer, kv.kind, kv.dtype, codec, heads, seq, k_dim, v_dim, len(kb), len(vb)
    )
    return [head, kb, vb]


def _expand(raw: memoryview, codec: Codec, nbytes: int, itemsize: int) -> bytes | memoryview:
    if codec == Codec.RAW:
        if len(raw) != nbytes:
            raise ProtocolError(f"raw K/V block is {len(raw)} bytes, shape says {nbytes}")
        return raw
    try:
        # max_output_size bounds what a hostile frame can make us allocate.
        out = zstandard.ZstdDecompressor().decompress(raw, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise ProtocolError(f"bad zstd block: {e}") from None
    if len(out) != nbytes:
        raise ProtocolError(f"zstd block expands to {len(out)} bytes, shape says {nbytes}")
    return _unshuffle(out, itemsize) if codec == Codec.SHUFFLE_ZSTD else out


def decode_layer(
    payload: bytearray | bytes | memoryview, max_bytes: int = DEFAULT_MAX_FRAME
) -> LayerKV:
    """Parse a KV_LAYER payload; raises ProtocolError on anything inconsistent.

    `max_bytes` caps what the layer may expand to, so a small compressed frame
    that claims a huge shape cannot make us allocate it.
    """
    if len(payload) < LAYER_HEADER.size:
        raise ProtocolError("KV_LAYER frame shorter than its header")
    layer, kind, dtype, codec, heads, seq, k_dim, v_dim, k_len, v_len = LAYER_HEADER.unpack_from(
        payload
    )
    try:
        kind_e, dtype_e, codec_e = Kind(kind), DType(dtype), Codec(codec)
    except ValueError as e:
        raise ProtocolError(f"KV_LAYER: {e}") from None
    if LAYER_HEADER.size + k_len + v_len != len(payload):
        raise ProtocolError("KV_LAYER block lengths do not add up to the frame length")
    np_dtype = np.dtype(WIRE_NUMPY[dtype_e])
    expanded = heads * seq * (k_dim + v_dim) * np_dtype.itemsize
    if expanded > max_bytes:
        raise ProtocolError(f"KV_LAYER claims {expanded} bytes, over the cap of {max_bytes}")
    view = memoryview(payload)[LAYER_HEADER.size :]
    k_raw = _expand(
        view[:k_len], codec_e, heads * seq * k_dim * np_dtype.itemsize, np_dtype.itemsize
    )
    v_raw = _expand(
        view[k_len:], codec_e, heads * seq * v_dim * np_dtype.itemsize, np_dtype.itemsize
    )
    keys = np.frombuffer(k_raw, np_dtype).reshape(heads, seq, k_dim)
    values = np.frombuffer(v_raw, np_dtype).reshape(heads, seq, v_dim)
    return LayerKV(layer, kind_e, dtype_e, keys, values)

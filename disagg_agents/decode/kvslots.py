"""Receive a prompt's K/V straight into the mlx arrays that decode then uses.

The copy path (kvfetch -> place -> kvplace.fill_layer) copies a layer about four
times on arrival. Here the decode loop's thread allocates each full-attention
layer's cache once, at the prompt length rounded up as mlx-lm's KVCache.step
wants (as fill_layer does, so decoding's first step writes in place), and the
receiving thread writes every KV_LAYER into numpy views of that memory: raw
bytes straight from the socket, zstd expanding into it, shuffled byte planes
and int8 rows scattered or dequantized into it, a prefix hit's cached blocks
copied into its first positions. mlx cannot wrap foreign memory, but an
evaluated mlx array exports its own, writable, through the buffer protocol.
bfloat16 has no numpy dtype: its views are uint16 words, as on the wire.

Only KVCache layers take this path. Sliding layers (RotatingKVCache: the last
window-1 tokens in a ring buffer) and other cache kinds keep the copy path, as
does any frame this layout does not fit (another dtype, a partial layer, a bad
header): it is read whole and given to kvcodec.decode_layer, which refuses what
is wrong with the same errors as before.

The views keep the arrays' buffers shared, which stops mlx from updating them
in place: `Slots.release` (and the prefix store's taking its copies) drops them
before decoding starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import zstandard
from mlx_lm.models.cache import KVCache, RotatingKVCache

from disagg_agents.wire.channel import FrameReader
from disagg_agents.wire.frames import Header, ProtocolError
from disagg_agents.wire.kvcodec import (
    DTYPE_NAMES,
    LAYER_HEADER,
    SCALE_DTYPE,
    WIRE_NUMPY,
    Codec,
    DType,
    Kind,
    LayerKV,
    as_array,
    block_bytes,
    decode_layer,
    expand_block,
    from_float32,
)

# "0": every layer takes the copy path (to compare with it, or to step around a
# platform whose mlx cannot export its buffers writable).
ENV = "DISAGG_KV_INPLACE"

MX_WIRE = {DType.FLOAT32: mx.float32, DType.FLOAT16: mx.float16, DType.BFLOAT16: mx.bfloat16}

# Copies a hit's cached prefix (layer, keys [H, start, D], values) into those views.
FillPrefix = Callable[[int, np.ndarray, np.ndarray], None]


def inplace_enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass
class Slots:
    """One request's full-attention caches as numpy views ([H, capacity, D], in
    the wire dtype) of the mlx memory they live in, for a receiver to fill."""

    prompt_len: int
    dtype: DType
    heads: int
    dim: int
    keys: dict[int, np.ndarray]
    values: dict[int, np.ndarray]
    placed: set[int] = field(default_factory=set)  # layers received in place
    # A prefix hit: positions [0, prefix_start) come from fill_prefix, the rest
    # from the stream (an older prefill agent sends all: taken as is).
    prefix_start: int = 0
    fill_prefix: FillPrefix | None = None
    # Per layer, a whole prompt's raw frame as flat byte views, K's heads then
    # V's: made with the slots (off the receive path), scattered into by one
    # recvmsg_into per socket read.
    scatter: dict[int, list[memoryview]] = field(default_factory=dict)
    # The layer header such a frame carries -> its layer: the common frame is
    # recognised by one lookup (anything else is planned by _plan).
    whole_raw: dict[bytes, int] = field(default_factory=dict)

    def release(self) -> None:
        """Drop the views (see the module's note); placed layers stay placed."""
        self.keys, self.values, self.scatter, self.whole_raw = {}, {}, {}, {}


def _wire_view(a: mx.array) -> np.ndarray:
    """A writable numpy view of an evaluated mx array's memory (bf16 as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)  # a view shares the buffer once evaluated
    view = np.array(a, copy=False)
    if not view.flags.writeable or not view.flags.c_contiguous:
        raise RuntimeError("mlx exported a read-only or strided cache buffer")
    return view


def allocate(caches: list[Any], prompt_len: int, dtype: str, heads: int, dim: int) -> Slots:
    """Each KVCache's arrays made at their final size and returned as views
    (mlx work: on the mlx thread). Other cache kinds are left for fill_layer."""
    wire = DTYPE_NAMES[dtype]
    slots = Slots(prompt_len, wire, heads, dim, {}, {})
    for i, cache in enumerate(caches):
        if isinstance(cache, RotatingKVCache) or not isinstance(cache, KVCache):
            continue  # the copy path: fill_layer knows their layouts
        # As fill_layer: room for decoding, so its first step writes in place.
        capacity = (prompt_len // cache.step + 1) * cache.step
        keys = mx.zeros((1, heads, capacity, dim), MX_WIRE[wire])
        values = mx.zeros((1, heads, capacity, dim), MX_WIRE[wire])
        mx.eval(keys, values)
        cache.keys, cache.values, cache.offset = keys, values, prompt_len
        slots.keys[i], slots.values[i] = _wire_view(keys)[0], _wire_view(values)[0]
        slots.scatter[i] = _head_views(slots.keys[i], slots.values[i], 0, prompt_len)
        block = heads * prompt_len * dim * slots.keys[i].itemsize  # K's, and V's
        head = (i, Kind.FULL, wire, Codec.RAW, 0, heads, prompt_len, dim, dim, block, block)
        slots.whole_raw[LAYER_HEADER.pack(*head)] = i
    return slots


def _head_views(keys: np.ndarray, values: np.ndarray, start: int, end: int) -> list[memoryview]:
    """Positions [start, end) of each head ([H, capacity, D] views), as flat byte
    views in wire order: one head's [S, D] is contiguous; K's heads, then V's."""
    return [_flat(dst[h, start:end]) for dst in (keys, values) for h in range(dst.shape[0])]


@dataclass(frozen=True)
class _Plan:
    layer: int
    start: int  # first position the frame carries
    codec: Codec
    quant: bool
    seq: int
    k_len: int
    v_len: int


def _plan(head: memoryview, length: int, slots: Slots, max_bytes: int) -> _Plan | None:
    """How a frame lands in place, or None: the copy path (which also reports
    whatever is wrong with the frame)."""
    layer, kind, dtype, codec, base, heads, seq, k_dim, v_dim, k_len, v_len = (
        LAYER_HEADER.unpack_from(head)
    )
    try:
        kind_e, dtype_e, codec_e = Kind(kind), DType(dtype), Codec(codec)
    except ValueError:
        return None
    quant = dtype_e == DType.INT8
    out = base if quant else dtype  # the dtype the layer restores to
    if kind_e != Kind.FULL or out != slots.dtype or (base != 0) != quant:
        return None
    if layer not in slots.keys or layer in slots.placed:
        return None
    if heads != slots.heads or k_dim != slots.dim or v_dim != slots.dim:
        return None
    if LAYER_HEADER.size + k_len + v_len != length:
        return None
    if seq == slots.prompt_len:
        start = 0
    elif slots.prefix_start and seq == slots.prompt_len - slots.prefix_start:
        start = slots.prefix_start
    else:
        return None
    itemsize = np.dtype(WIRE_NUMPY[slots.dtype]).itemsize
    rows = heads * seq  # decode_layer's cap, so both paths refuse the same frames
    expanded = 2 * rows * k_dim * itemsize
    if quant:
        expanded = max(expanded, 2 * rows * (SCALE_DTYPE.itemsize + k_dim))
    if expanded > max_bytes:
        return None
    if codec_e == Codec.RAW and not quant and k_len != heads * seq * k_dim * itemsize:
        return None
    return _Plan(layer, start, codec_e, quant, seq, k_len, v_len)


def _flat(a: np.ndarray) -> memoryview:
    """A contiguous array's bytes as a flat writable memoryview."""
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _bytes_planes(dst: np.ndarray) -> np.ndarray:
    """[H, S, D] view (last axis contiguous) -> [H, S, D, itemsize] uint8 view."""
    b = dst.view(np.uint8)
    b.shape = (*dst.shape, dst.itemsize)  # raises rather than copy
    return b


def _unzstd_into(raw: memoryview, nbytes: int, sink: Callable[[Any], None], parts: int) -> None:
    """Expand one zstd block of `nbytes` in `parts` equal pieces, each handed to
    `sink` as a writable buffer it has just received into."""
    try:
        declared = zstandard.frame_content_size(raw)
        if declared not in (-1, nbytes):
            raise ProtocolError(f"zstd block declares {declared} bytes, shape says {nbytes}")
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        got = 0
        piece = nbytes // parts
        scratch = np.empty(piece, np.uint8)  # one piece, reused
        view = memoryview(scratch)  # type: ignore[arg-type]
        for _ in range(parts):
            at = 0
            while at < piece:
                n = reader.readinto(view[at:])
                if n == 0:
                    raise ProtocolError(
                        f"zstd block expands to {got + at} bytes, shape says {nbytes}"
                    )
                at += n
            got += at
            sink(scratch)
        if reader.read(1):
            raise ProtocolError(f"zstd block expands past the {nbytes} bytes its shape says")
    except zstandard.ZstdError as e:
        raise ProtocolError(f"bad zstd block: {e}") from None


def _unzstd_direct(raw: memoryview, nbytes: int, dst: np.ndarray) -> None:
    """Expand one zstd block straight into `dst` ([H, S, D], rows contiguous)."""
    try:
        declared = zstandard.frame_content_size(raw)
        if declared not in (-1, nbytes):
            raise ProtocolError(f"zstd block declares {declared} bytes, shape says {nbytes}")
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        got = 0
        for h in range(dst.shape[0]):  # one head's [S, D] is contiguous
            view, at = _flat(dst[h]), 0
            while at < len(view):
                n = reader.readinto(view[at:])
                if n == 0:
                    raise ProtocolError(
                        f"zstd block expands to {got + at} bytes, shape says {nbytes}"
                    )
                at += n
            got += at
        if reader.read(1):
            raise ProtocolError(f"zstd block expands past the {nbytes} bytes its shape says")
    except zstandard.ZstdError as e:
        raise ProtocolError(f"bad zstd block: {e}") from None


def _lossless_into(raw: memoryview, codec: Codec, dst: np.ndarray) -> None:
    """One compressed K or V block into `dst` ([H, S, D] view, wire dtype)."""
    nbytes = dst.size * dst.itemsize
    if codec == Codec.ZSTD:
        _unzstd_direct(raw, nbytes, dst)
        return
    # Shuffled: byte plane i (byte i of every element) expands into a scratch of
    # one plane, then scatters into the elements' byte i in place.
    planes = _bytes_planes(dst)
    shape = dst.shape
    at = [0]

    def sink(plane: np.ndarray) -> None:
        planes[..., at[0]] = plane.reshape(shape)
        at[0] += 1

    _unzstd_into(raw, nbytes, sink, dst.itemsize)


def _dequant_into(raw: memoryview, codec: Codec, dst: np.ndarray, dtype: DType) -> None:
    """One int8 block (row scales, then int8 rows) dequantized into `dst`, bit
    for bit as kvcodec.dequantize_rows."""
    heads, seq, dim = dst.shape
    rows = heads * seq
    block = expand_block(raw, codec, rows * (SCALE_DTYPE.itemsize + dim))
    split = rows * SCALE_DTYPE.itemsize
    scale = as_array(memoryview(block)[:split], codec, SCALE_DTYPE, (heads, seq))
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise ProtocolError("KV_LAYER int8 block has a negative or non-finite row scale")
    q = np.frombuffer(memoryview(block)[split:], np.int8).reshape(heads, seq, dim)
    if dtype == DType.BFLOAT16:
        for h in range(heads):  # rounded by hand, a head at a time
            dst[h] = from_float32(np.multiply(q[h], scale[h, :, None], dtype=np.float32), dtype)
    else:  # float32 products, cast to the wire dtype as astype does
        np.multiply(q, scale[..., None], out=dst, dtype=np.float32, casting="same_kind")


def _whole_raw(
    reader: FrameReader, head: memoryview, length: int, slots: Slots, max_bytes: int
) -> tuple[LayerKV, float, int] | None:
    """The common frame, a whole prompt's raw layer, read into its cache (what
    _plan and the general path below do for it, with the work done in allocate)."""
    layer = slots.whole_raw.get(bytes(head))
    payload = length - LAYER_HEADER.size
    if layer is None or layer in slots.placed or payload > max_bytes:
        return None
    keys, values = slots.keys[layer], slots.values[layer]
    if payload != 2 * keys[:, : slots.prompt_len].nbytes:
        return None
    reader.read_into_many(slots.scatter[layer])
    reader.finish()  # checks a sealed frame's tag before anyone uses it
    arrived = time.perf_counter()
    slots.placed.add(layer)
    kv = LayerKV(
        layer, Kind.FULL, slots.dtype, keys[:, : slots.prompt_len], values[:, : slots.prompt_len]
    )
    return kv, arrived, payload


def _read_planned(reader: FrameReader, length: int, plan: _Plan, slots: Slots) -> float:
    """A planned frame's blocks into the cache past the prefix: raw ones read
    straight into it, others decoded into it. Returns when its bytes had all
    arrived."""
    keys = slots.keys[plan.layer][:, : slots.prompt_len]
    values = slots.values[plan.layer][:, : slots.prompt_len]
    dk, dv = keys[:, plan.start :], values[:, plan.start :]
    if plan.codec == Codec.RAW and not plan.quant:
        if plan.start == 0:
            views = slots.scatter[plan.layer]
        else:
            views = _head_views(
                slots.keys[plan.layer], slots.values[plan.layer], plan.start, slots.prompt_len
            )
        reader.read_into_many(views)
        reader.finish()  # checks a sealed frame's tag before anyone uses it
        return time.perf_counter()
    blocks = reader.buffer(length)[LAYER_HEADER.size :]
    reader.read_into(blocks)
    reader.finish()
    arrived = time.perf_counter()
    k_raw, v_raw = blocks[: plan.k_len], blocks[plan.k_len :]
    for raw, dst in ((k_raw, dk), (v_raw, dv)):
        if plan.quant:
            _dequant_into(raw, plan.codec, dst, slots.dtype)
        else:
            _lossless_into(raw, plan.codec, dst)
    return arrived


def receive_layer(
    reader: FrameReader, header: Header, slots: Slots, max_bytes: int
) -> tuple[LayerKV, float, int]:
    """Take one KV_LAYER frame whose header `reader` just read: in place when it
    fits `slots` (then the layer is in `slots.placed` and the LayerKV's arrays
    are views of the whole prompt in the cache, a prefix hit's included), else
    whole into the reader's buffer and decoded as before. Also returns when its
    bytes had all arrived, and its K/V bytes as the codec saw them (block_bytes
    of what crossed, not of the prefix)."""
    n = LAYER_HEADER.size
    plan = None
    if header.length >= n:
        # Only the header into the reader's buffer: a raw frame in place never
        # needs the whole frame's worth of it (allocated and zeroed per request).
        head = reader.buffer(n)
        reader.read_into(head)
        whole = _whole_raw(reader, head, header.length, slots, max_bytes)
        if whole is not None:
            return whole
        plan = _plan(head, header.length, slots, max_bytes)
    if plan is None:
        buf = reader.buffer(header.length)  # a new buffer when it grew: the header too
        if header.length >= n:
            buf[:n] = head
        reader.read_into(buf[min(n, header.length) :])
        reader.finish()
        kv = decode_layer(buf, max_bytes)
        return kv, time.perf_counter(), block_bytes(kv)
    keys = slots.keys[plan.layer][:, : slots.prompt_len]
    values = slots.values[plan.layer][:, : slots.prompt_len]
    arrived = _read_planned(reader, header.length, plan, slots)
    if plan.start:
        assert slots.fill_prefix is not None
        slots.fill_prefix(plan.layer, keys[:, : plan.start], values[:, : plan.start])
    slots.placed.add(plan.layer)
    quant = "int8" if plan.quant else None
    kv = LayerKV(plan.layer, Kind.FULL, slots.dtype, keys, values, quant)
    rows = slots.heads * plan.seq
    if plan.quant:
        crossed = 2 * rows * (slots.dim + SCALE_DTYPE.itemsize)
    else:
        crossed = 2 * rows * slots.dim * keys.itemsize
    return kv, arrived, crossed

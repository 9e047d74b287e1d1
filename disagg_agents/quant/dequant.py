"""Dequantization in torch, bit-identical to `mx.dequantize` of the same tensors.

Packed layouts (as mlx stores them; bytes are little-endian on every host we run):
- affine, bits 2..8: per row, a little-endian bitstream of `in` unsigned ints,
  element j at bits j*b..j*b+b-1; `w = q * scale + bias` per group of
  `group_size` consecutive inputs, computed in the scales' dtype as two rounded
  ops (mlx does not fuse them into an fma: checked against mx.dequantize).
- mxfp4 / nvfp4: E2M1 nibbles, low nibble first; scale per group is E8M0
  (2^(e-127), group 32) or E4M3 (group 16).
- mxfp8: E4M3 bytes, E8M0 scale per group of 32.
The fp modes multiply value and scale in the target dtype, as mlx does (one
rounding of an exact product in fp32 and bf16).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}  # mode -> (bits, group)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QSpec:
    """How one tensor was quantized."""

    mode: str  # affine | mxfp4 | mxfp8 | nvfp4
    bits: int
    group_size: int


def unpack_affine(packed: torch.Tensor, bits: int, n_in: int) -> torch.Tensor:
    """uint8 bytes [..., n_in*bits/8] -> uint8 codes [..., n_in]."""
    lead = packed.shape[:-1]
    if bits in (2, 4, 8):
        per = 8 // bits
        if per == 1:
            return packed[..., :n_in]
        mask = (1 << bits) - 1
        # One plain op per shift, stacked: about 2x faster than broadcasting the shifts.
        parts = [(packed >> s) & mask if s else packed & mask for s in range(0, 8, bits)]
        codes = torch.stack(parts, dim=-1)  # [..., bytes, per]
        return codes.reshape(*lead, -1)[..., :n_in]
    # 3/5/6 bits: 8 codes fill exactly `bits` bytes; read them as one integer.
    chunks = packed.reshape(*lead, -1, bits).to(torch.int64)
    word = torch.zeros(chunks.shape[:-1], dtype=torch.int64, device=packed.device)
    for k in range(bits):
        word |= chunks[..., k] << (8 * k)
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=torch.int64)
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, -1)[..., :n_in].to(torch.uint8)


def dequant_affine(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    n_in: int,
) -> torch.Tensor:
    """[..., out, in] in the scales' dtype: codes * scale, then + bias, each rounded."""
    codes = unpack_affine(packed, bits, n_in)
    lead = codes.shape[:-1]
    w = codes.to(scales.dtype).reshape(*lead, n_in // group_size, group_size)
    w.mul_(scales.unsqueeze(-1))
    w.add_(biases.unsqueeze(-1))
    return w.reshape(*lead, n_in)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(e-127) in float32, exactly (e=0 is the subnormal 2^-127)."""
    ei = e.to(torch.int32)
    normal = (ei << 23).view(torch.float32)
    return torch.where(ei == 0, torch.full_like(normal, 2.0**-127), normal)


_PAIRS: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def e2m1_pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: the two E2M1 values of each byte, low nibble first; made once per
    device (a table built from a list per call is a blocking host-to-device copy)."""
    key = (str(device), dtype)
    if key not in _PAIRS:
        vals = torch.tensor(E2M1, dtype=torch.float32)
        byte = torch.arange(256)
        pairs = torch.stack((vals[byte & 0x0F], vals[byte >> 4]), dim=-1)
        _PAIRS[key] = pairs.to(device=device, dtype=dtype)
    return _PAIRS[key]


def dequant_fp(
    packed: torch.Tensor, scales: torch.Tensor, mode: str, n_in: int, dtype: torch.dtype
) -> torch.Tensor:
    """mxfp4 / mxfp8 / nvfp4 bytes [..., out, in*bits/8] -> [..., out, in] in `dtype`.

    Value and scale are converted to `dtype` and multiplied there, as mlx does: a
    value times a power of two rounds once, so fp32 and bf16 get the exact product
    rounded; in fp16 a scale outside its range is 0 or inf, in mlx too.
    """
    bits, group = FP_MODES[mode]
    lead = packed.shape[:-1]
    if bits == 4:
        # One table row per byte: an int32 index per byte, not an int64 per value.
        pairs = F.embedding(packed.to(torch.int32), e2m1_pairs(packed.device, dtype))
        vals = pairs.reshape(*lead, -1)[..., :n_in]
    else:
        vals = packed[..., :n_in].view(torch.float8_e4m3fn).to(dtype)
    if mode == "nvfp4":
        scale = scales.view(torch.float8_e4m3fn).to(dtype)
    else:
        scale = e8m0_to_float(scales).to(dtype)
    w = vals.reshape(*lead, n_in // group, group) * scale.unsqueeze(-1)
    return w.reshape(*lead, n_in)


@contextmanager
def one_thread(t: torch.Tensor) -> Iterator[None]:
    """Dequantization on a CPU runs on one thread. Its few elementwise ops per weight
    are memory-bound, and each is a parallel region: on a busy machine every region
    waits for a second core (a 4-bit 576x1536 weight took 38 ms on two contended
    threads, 2 ms on one). The results are the same bits either way."""
    n = torch.get_num_threads()
    if t.device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Packed:
    """One quantized weight [..., out, in], kept packed; `full`/`rows`/`expert`
    dequantize just what is asked for, in the compute dtype.

    `packed` is the weight's raw bytes (mlx's uint32 words viewed as uint8);
    affine scales/biases are held in the compute dtype, as the decode agent's
    `set_dtype` holds them, so both sides dequantize the same numbers.
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        biases: torch.Tensor | None,
        spec: QSpec,
        n_in: int,
        dtype: torch.dtype,
    ) -> None:
        if packed.dtype != torch.uint8:
            packed = packed.contiguous().view(torch.uint8)
        if spec.mode == "affine":
            if biases is None:
                raise ValueError("affine quantization needs biases")
            scales, biases = scales.to(dtype), biases.to(dtype)
        expect = n_in * spec.bits // 8
        if packed.shape[-1] != expect or scales.shape[-1] * spec.group_size != n_in:
            raise ValueError(
                f"packed shape {tuple(packed.shape)} / scales {tuple(scales.shape)} do not fit "
                f"{n_in} inputs at {spec.bits} bits, group {spec.group_size}"
            )
        self.packed, self.scales, self.biases = packed, scales, biases
        self.spec, self.n_in, self.dtype = spec, n_in, dtype
        self.shape: tuple[int, ...] = (*packed.shape[:-1], n_in)
        self.kept: torch.Tensor | None = None  # the full-precision weight, once `keep` ran

    @property
    def nbytes(self) -> int:
        """Bytes held now: packed, or the kept full-precision weight."""
        if self.kept is not None:
            return self.kept.nbytes
        extra = self.biases.nbytes if self.biases is not None else 0
        return self.packed.nbytes + self.scales.nbytes + extra

    @property
    def full_nbytes(self) -> int:
        """Bytes of the weight dequantized."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def to(self, device: torch.device | str) -> Packed:
        if self.kept is not None:
            moved = copy.copy(self)
            moved.kept = self.kept.to(device)
            return moved
        b = self.biases.to(device) if self.biases is not None else None
        return Packed(
            self.packed.to(device), self.scales.to(device), b, self.spec, self.n_in, self.dtype
        )

    def keep(self) -> int:
        """Dequantize once, for good: `full`, `rows` and `expert` read the kept tensor
        from now on, and the packed bytes are let go. Returns the bytes added."""
        if self.kept is not None:
            return 0
        before = self.nbytes
        self.kept = self.full()
        empty = torch.empty(0, dtype=torch.uint8, device=self.packed.device)
        self.packed, self.scales = empty, empty
        self.biases = None
        return self.kept.nbytes - before

    def _dequant(
        self, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None
    ) -> torch.Tensor:
        if self.spec.mode == "affine":
            assert biases is not None
            return dequant_affine(
                packed, scales, biases, self.spec.bits, self.spec.group_size, self.n_in
            )
        return dequant_fp(packed, scales, self.spec.mode, self.n_in, self.dtype)

    def full(self) -> torch.Tensor:
        """The whole weight (all experts of a stacked one in one batched op)."""
        if self.kept is not None:
            return self.kept
        with one_thread(self.packed):
            return self._dequant(self.packed, self.scales, self.biases)

    def rows(self, idx: torch.Tensor | slice) -> torch.Tensor:
        """Only the rows `idx` along the first axis: of a 2-D weight (embedding
        lookups, chunked heads), or the experts `idx` of a stacked one."""
        if self.kept is not None:
            return self.kept[idx]
        b = self.biases[idx] if self.biases is not None else None
        with one_thread(self.packed):
            return self._dequant(self.packed[idx], self.scales[idx], b)

    def expert(self, e: int) -> torch.Tensor:
        """Expert `e` of a stacked [E, out, in] weight."""
        return self.rows(e)  # type: ignore[arg-type]

"""Dequantization in torch, bit-identical to `mx.dequantize` of the same tensors.

Packed layouts (as mlx stores them; bytes are little-endian on every host we run):
- affine, bits 2..8: per row, a little-endian bitstream of `in` unsigned ints,
  element j at bits j*b..j*b+b-1; `w = q * scale + bias` per group of
  `group_size` consecutive inputs, computed in the scales' dtype as two rounded
  ops (mlx does not fuse them into an fma: checked against mx.dequantize).
- mxfp4 / nvfp4: E2M1 nibbles, low nibble first; scale per group is E8M0
  (2^(e-127), group 32) or E4M3 (group 16).
- mxfp8: E4M3 bytes, E8M0 scale per group of 32.
The fp products are exact in float32 (few mantissa bits), so they are computed
there and rounded once into the target dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}  # mode -> (bits, group)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QSpec:
    """How one tensor was quantized."""

    mode: str  # affine | mxfp4 | mxfp8 | nvfp4
    bits: int
    group_size: int

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "bits": self.bits, "group_size": self.group_size}


def unpack_affine(packed: torch.Tensor, bits: int, n_in: int) -> torch.Tensor:
    """uint8 bytes [..., n_in*bits/8] -> uint8 codes [..., n_in]."""
    lead = packed.shape[:-1]
    if bits in (2, 4, 8):
        per = 8 // bits
        if per == 1:
            return packed[..., :n_in]
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., bytes, per]
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


def dequant_fp(
    packed: torch.Tensor, scales: torch.Tensor, mode: str, n_in: int, dtype: torch.dtype
) -> torch.Tensor:
    """mxfp4 / mxfp8 / nvfp4 bytes [..., out, in*bits/8] -> [..., out, in] in `dtype`."""
    bits, group = FP_MODES[mode]
    lead = packed.shape[:-1]
    if bits == 4:
        lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
        nib = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, -1)[..., :n_in]
        vals = lut[nib.to(torch.int64)]
    else:
        vals = packed[..., :n_in].view(torch.float8_e4m3fn).to(torch.float32)
    if mode == "nvfp4":
        scale = scales.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        scale = e8m0_to_float(scales)
    w = vals.reshape(*lead, n_in // group, group) * scale.unsqueeze(-1)
    return w.reshape(*lead, n_in).to(dtype)


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

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.n_in)

    @property
    def nbytes(self) -> int:
        extra = self.biases.nbytes if self.biases is not None else 0
        return self.packed.nbytes + self.scales.nbytes + extra

    def to(self, device: torch.device | str) -> Packed:
        b = self.biases.to(device) if self.biases is not None else None
        return Packed(
            self.packed.to(device), self.scales.to(device), b, self.spec, self.n_in, self.dtype
        )

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
        return self._dequant(self.packed, self.scales, self.biases)

    def rows(self, idx: torch.Tensor | slice) -> torch.Tensor:
        """Only the rows `idx` of a 2-D weight (embedding lookups, chunked heads)."""
        b = self.biases[idx] if self.biases is not None else None
        return self._dequant(self.packed[idx], self.scales[idx], b)

    def expert(self, e: int) -> torch.Tensor:
        """Expert `e` of a stacked [E, out, in] weight."""
        return self.rows(e)  # type: ignore[arg-type]

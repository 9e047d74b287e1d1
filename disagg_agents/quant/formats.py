"""What a model dir's weights are: the quantization it declares, formats we refuse
with one clear line, and a cheap identity of the weights for the handshake.

Torch- and mlx-free: both agents (and the control plane) import it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from ..models.base import UnsupportedModel, load_hf_config

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
SUPPORTED = (
    "supported: full-precision safetensors, MLX affine 2-8 bit and mxfp4/mxfp8/nvfp4 "
    "(mlx_lm.convert -q), OpenAI's MXFP4 gpt-oss"
)
CONVERT = "convert with: mlx_lm.convert --hf-path <original model> --mlx-path <dir> -q --q-bits 4"
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


def mlx_quantization(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The `quantization` dict mlx-lm wrote (defaults + per-module overrides), or the
    one mlx-lm derives from an HF `quant_method` it loads packed, or None."""
    q = cfg.get("quantization")
    if isinstance(q, dict):
        return q
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        method = qc.get("quant_method")
        if method is None and "bits" in qc:
            return qc  # mlx-lm writes the same dict here too
        if method == "mxfp4":
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return None


def quant_summary(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Mode, bits, group size and overrides, as the fingerprint carries them."""
    q = mlx_quantization(cfg)
    if q is None:
        return None
    out: dict[str, Any] = {
        "mode": q.get("mode", "affine"),
        "bits": q.get("bits"),
        "group_size": q.get("group_size"),
    }
    overrides = {k: v for k, v in q.items() if isinstance(v, dict | bool)}
    if overrides:
        out["overrides"] = overrides
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method:
        out["format"] = f"hf-{method}"
    return out


def _refuse(path: Path, found: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"{path}: {found} checkpoints are not supported ({SUPPORTED}); {CONVERT}"
    )


def check_supported(model_dir: str | Path) -> None:
    """Raise UnsupportedModel with one line if neither agent can run this dir's
    weights: the format found, what is supported, how to convert."""
    path = Path(model_dir)
    if path.is_file() and path.suffix == ".gguf":
        raise _refuse(path, "GGUF (a single .gguf file)")
    if path.is_dir() and not list(path.glob("*.safetensors")):
        if list(path.glob("*.gguf")):
            raise _refuse(path, "GGUF")
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise _refuse(path, "PyTorch .bin/.pt (no safetensors)")
    cfg = load_hf_config(path)
    if (path / "hf_quant_config.json").is_file():
        raise _refuse(path, "NVIDIA ModelOpt (hf_quant_config.json)")
    if not list(path.glob("*.safetensors")):
        raise UnsupportedModel(f"{path} has no *.safetensors weights")
    _check_format(path, cfg)  # what the config says first: the fix names the format
    for file in weight_files(path):
        read_header(file)  # a hostile header: one line here, before any loader sees it


def _check_format(path: Path, cfg: dict[str, Any]) -> None:
    """Refuse, in one line, a quantization neither agent runs."""
    qc = cfg.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method is not None and method != "mxfp4":
        names = {
            "compressed-tensors": "compressed-tensors (e.g. NVFP4)",
            "modelopt": "NVIDIA ModelOpt NVFP4",
            "gptq": "GPTQ",
            "awq": "AWQ",
            "bitsandbytes": "bitsandbytes",
            "fp8": "FP8",
        }
        raise _refuse(path, names.get(str(method), f"quant_method {method!r}"))
    if method == "mxfp4" and cfg.get("model_type") != "gpt_oss":
        raise _refuse(path, f"HF MXFP4 {cfg.get('model_type')}")
    q = mlx_quantization(cfg)
    if q is None:
        return
    for where, spec in [("", q), *[(k, v) for k, v in q.items() if isinstance(v, dict)]]:
        mode, bits = spec.get("mode", q.get("mode", "affine")), spec.get("bits", q.get("bits"))
        group = spec.get("group_size", q.get("group_size"))
        at = f" at {where}" if where else ""
        if spec.get("global_scale"):
            raise _refuse(path, f"MLX {mode} with a global scale{at}")
        if mode == "affine":
            if bits not in AFFINE_BITS or not isinstance(group, int) or group <= 0:
                raise _refuse(path, f"MLX affine {bits}-bit group {group}{at}")
        elif mode in FP_MODES:
            if (bits, group) != FP_MODES[mode]:
                raise _refuse(path, f"MLX {mode} {bits}-bit group {group}{at}")
        else:
            raise _refuse(path, f"MLX quantization mode {mode!r}{at}")


def is_quantized(cfg: dict[str, Any]) -> bool:
    return mlx_quantization(cfg) is not None


# Bytes per element of safetensors' dtypes (F4/F6 and the like: checked for fit only).
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "F8_E8M0": 1,
}  # fmt: skip


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset where its data starts,
    checked (`check_header`): a hostile file gets one line, never a traceback."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UnsupportedModel(f"{file} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise UnsupportedModel(f"{file} is not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnsupportedModel(f"{file} has a broken safetensors header: {e}") from None
        except RecursionError:
            why = "nested too deeply"
            raise UnsupportedModel(f"{file} has a broken safetensors header: {why}") from None
        except ValueError as e:  # ints of 4300+ digits
            raise UnsupportedModel(f"{file} has a broken safetensors header: {e}") from None
    check_header(file, header, file.stat().st_size - 8 - n)
    return header, 8 + n


def check_header(file: Path, header: Any, data_bytes: int) -> None:
    """Every tensor's offsets ascend without overlap, fit the file's data, and span
    exactly shape x itemsize bytes; else UnsupportedModel naming the tensor."""
    if not isinstance(header, dict):
        raise UnsupportedModel(f"{file}: the safetensors header is not a JSON object")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        bad = f"{file}: tensor {str(name)[:80]!r}"
        if not isinstance(entry, dict):
            raise UnsupportedModel(f"{bad} has no dtype/shape/data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        ints = (isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape or [None])
        if not isinstance(shape, list) or (shape and not all(ints)):
            raise UnsupportedModel(f"{bad} has a bad shape {str(shape)[:80]}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise UnsupportedModel(f"{bad} has bad data_offsets {str(offsets)[:80]}")
        if offsets[1] > data_bytes:
            raise UnsupportedModel(
                f"{bad} ends at byte {offsets[1]} of {data_bytes}: the file is truncated or lies"
            )
        count = 1
        for d in shape:
            count *= d
        size = ITEMSIZE.get(str(dtype))
        if size is not None and count * size != offsets[1] - offsets[0]:
            raise UnsupportedModel(
                f"{bad}: shape {shape} x {size} bytes is {count * size}, "
                f"but its data_offsets span {offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], str(name)[:80]))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise UnsupportedModel(f"{file}: tensors {a!r} and {b!r} overlap")


def weight_files(model_dir: str | Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def weights_digest(model_dir: str | Path, sample: int = 4096) -> str:
    """Digest of every safetensors header (names, dtypes, shapes, offsets) plus a
    few KiB of data at three places per file: cheap (no GBs hashed), and two dirs
    holding copies of the same files agree, while different weights (another
    quantization, dtype, or fine-tune) almost surely do not."""
    h = hashlib.sha256()
    for file in weight_files(model_dir):
        header, start = read_header(file)
        h.update(json.dumps(header, sort_keys=True).encode())
        size = file.stat().st_size
        with open(file, "rb") as f:
            for at in (start, start + (size - start) // 2, max(start, size - sample)):
                f.seek(at)
                h.update(f.read(sample))
    return h.hexdigest()[:16]


def weights_identity(model_dir: str | Path) -> dict[str, Any]:
    """The `weights` entry of an agent's fingerprint."""
    cfg = load_hf_config(model_dir)
    return {"quantization": quant_summary(cfg), "digest": weights_digest(model_dir)}


def describe(weights: dict[str, Any] | None) -> str:
    """`4-bit affine g64 (digest ab12...)`, for the one-line refusal."""
    if not weights:
        return "unknown weights"
    q = weights.get("quantization")
    kind = f"{q.get('bits')}-bit {q.get('mode')} g{q.get('group_size')}" if q else "full precision"
    return f"{kind} (weights {weights.get('digest')})"


def weights_mismatch(
    ours: dict[str, Any], theirs: dict[str, Any], ours_dir: str, theirs_dir: str
) -> str | None:
    """One line naming both sides and the fix, or None when the weights are the same."""
    a, b = ours.get("weights"), theirs.get("weights")
    if a == b:
        return None
    return (
        f"different weights: prefill has {ours_dir}, {describe(a)}; decode has {theirs_dir}, "
        f"{describe(b)}: use the same model dir on both sides, or allow it with "
        "mixed_weights = true / --allow-mixed"
    )

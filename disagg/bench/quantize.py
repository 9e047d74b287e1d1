"""Quantized copies of a model dir, made the way users make them (`mlx_lm.convert -q`),
once per machine: what `disagg bench quant-weights` and the tests run on."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disagg.errors import ModelError
from disagg.serving.defaultmodel import Say, cache_root, ensure_default_model


def quant_cache() -> Path:
    """Per mlx-lm version: a newer converter may write another layout."""
    import mlx_lm

    return cache_root() / "quant" / f"mlx-lm-{mlx_lm.__version__}"


def publish(build: Callable[[Path], Any], out: Path) -> Path:
    """Build into a temp dir beside `out`, then rename: a half-written dir is never seen."""
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        build(tmp / "m")
        os.replace(tmp / "m", out)
    except OSError:
        if not out.is_dir():  # another process published it first: fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def mlx_quantized(src: Path, name: str, **convert: Any) -> Path:
    """`src` converted by mlx_lm.convert with quantize=True and `convert`'s options
    (q_bits, q_group_size, q_mode), cached as `name`."""

    def build(dst: Path) -> None:
        import mlx_lm

        try:
            mlx_lm.convert(hf_path=str(src), mlx_path=str(dst), quantize=True, **convert)
        except (ValueError, TypeError) as e:
            raise ModelError(f"mlx_lm.convert could not quantize {src}: {e}") from None

    return publish(build, quant_cache() / name)


def default_quantized(bits: int = 4, group_size: int = 64, say: Say = lambda _m: None) -> Path:
    """The embedded default model at MLX affine `bits`, as `mlx_lm.convert -q` writes it."""
    out = quant_cache() / f"smol-affine{bits}"
    if not out.is_dir():
        say(f"quantizing the default model to {bits}-bit with mlx_lm.convert (once)")
    return mlx_quantized(ensure_default_model(say), out.name, q_bits=bits, q_group_size=group_size)

"""Give mlx's Linux CPU build an optimized BLAS.

The `mlx[cpu]` wheel for Linux bundles netlib's reference BLAS: about 2 GFLOP/s
here, and its cost grows linearly with batch size, so a batched decode step
costs as much as decoding each request alone. A Mac's Accelerate has no such
problem. Loading OpenBLAS globally before mlx resolves `cblas_sgemm` to it
(libmlx looks symbols up in the global scope first), which makes the Linux
stand-in behave like the real decode host: about 3x faster single-stream and
batched steps that cost little more than one.

torch is unaffected: it carries its own BLAS under its own symbols.
Set DISAGG_BLAS=bundled to keep mlx's own BLAS, or DISAGG_BLAS=/path/to/lib.so
to choose the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

# What this process ended up with, for the agent's status: "openblas:<path>" or "bundled".
loaded = "bundled"


def find_openblas() -> str | None:
    for path in CANDIDATES:
        if Path(path).exists():
            return path
    return ctypes.util.find_library("openblas")


def preload() -> str:
    """Load OpenBLAS with global symbols if this is Linux and one is installed.
    Must run before mlx is imported; afterwards it changes nothing."""
    global loaded
    choice = os.environ.get("DISAGG_BLAS", "auto")
    if sys.platform != "linux" or choice == "bundled" or "mlx.core" in sys.modules:
        return loaded
    path = find_openblas() if choice == "auto" else choice
    if path:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            loaded = f"openblas:{path}"
        except OSError:
            pass  # a broken install only costs speed, never correctness
    return loaded

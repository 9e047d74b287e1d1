"""Give mlx's Linux CPU build an optimized matmul.

The `mlx[cpu]` wheel for Linux bundles netlib's reference BLAS: about 2 GFLOP/s
here, with a cost linear in batch size, so a batched decode step costs as much
as decoding each request alone. A Mac's Accelerate has no such problem.

libmlx looks its symbols up in the global scope first, so a library loaded
globally before mlx that defines `cblas_sgemm` (and the d/c variants, the only
BLAS calls mlx makes) takes over its matmuls. OpenBLAS itself must not be loaded
globally: it also exports the Fortran `sgemm_` that torch's bundled MKL calls
through its PLT, and torch would then run on OpenBLAS, 2-6x slower. So a
three-function shim, compiled once with the system C compiler into the cache,
is the only global library; it forwards to OpenBLAS opened privately.

Linux only, and only when OpenBLAS and a C compiler are there; otherwise mlx
keeps its own BLAS (correct, slower). DISAGG_BLAS=bundled keeps it always;
DISAGG_BLAS=/path/libopenblas.so picks the library.

Importing this module does it (`preload()`), so what runs mlx imports it before
mlx: the decode agent and the mlx benchmarks. The CLI and the control plane never
import it, and never compile or load the shim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

SHIM_C = r"""
#include <dlfcn.h>
#include <stdlib.h>
typedef void (*gemm_t)();
static gemm_t s, d, c;
__attribute__((constructor)) static void load(void) {
    void *h = dlopen(getenv("DISAGG_OPENBLAS_PATH"), RTLD_NOW | RTLD_LOCAL);
    if (!h) abort();
    s = (gemm_t)dlsym(h, "cblas_sgemm");
    d = (gemm_t)dlsym(h, "cblas_dgemm");
    c = (gemm_t)dlsym(h, "cblas_cgemm");
    if (!s || !d || !c) abort();
}
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a,
                 int lda, const float *b, int ldb, float be, float *cc, int ldc) {
    ((void (*)(int, int, int, int, int, int, float, const float *, int, const float *,
               int, float, float *, int))s)(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc);
}
void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double al, const double *a,
                 int lda, const double *b, int ldb, double be, double *cc, int ldc) {
    ((void (*)(int, int, int, int, int, int, double, const double *, int, const double *,
               int, double, double *, int))d)(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc);
}
void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void *al, const void *a,
                 int lda, const void *b, int ldb, const void *be, void *cc, int ldc) {
    ((void (*)(int, int, int, int, int, int, const void *, const void *, int, const void *,
               int, const void *, void *, int))c)(o, ta, tb, m, n, k, al, a, lda, b, ldb, be,
                                                   cc, ldc);
}
"""

# What this process ended up with, for status and bench reports.
loaded = "bundled"


def find_openblas() -> str | None:
    for path in CANDIDATES:
        if Path(path).exists():
            return path
    return ctypes.util.find_library("openblas")


def _shim() -> Path | None:
    """The compiled shim, built once per source version into the user's cache."""
    cache = Path(os.environ.get("DISAGG_CACHE") or Path.home() / ".cache" / "disagg")
    tag = hashlib.sha256(SHIM_C.encode()).hexdigest()[:12]
    lib = cache / "blas" / f"mlx-openblas-shim-{tag}.so"
    if lib.exists():
        return lib
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "shim.c", Path(tmp) / lib.name
        src.write_text(SHIM_C)
        done = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"],
            capture_output=True,
            timeout=60,
        )
        if done.returncode != 0:
            return None
        os.replace(out, lib)  # atomic: concurrent agents never load half a file
    return lib


def preload() -> str:
    """Route mlx's matmuls to OpenBLAS if this is Linux and it can be done.
    Must run before mlx is imported; afterwards it changes nothing."""
    global loaded
    choice = os.environ.get("DISAGG_BLAS", "auto")
    if sys.platform != "linux" or choice == "bundled" or "mlx.core" in sys.modules:
        return loaded
    path = find_openblas() if choice == "auto" else choice
    if not path:
        return loaded
    try:
        shim = _shim()
        if shim is None:
            return loaded
        os.environ["DISAGG_OPENBLAS_PATH"] = path  # read by the shim's constructor
        ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
        loaded = f"openblas:{path}"
    except (OSError, subprocess.SubprocessError):
        pass  # a broken install only costs speed, never correctness
    return loaded


preload()

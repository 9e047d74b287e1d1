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

Which OpenBLAS (DISAGG_BLAS; default `auto`):
  auto     numpy's, else the scipy-openblas wheels, else the system's
  numpy    the one numpy's wheel bundles (numpy.libs/libscipy_openblas64_*.so)
  wheel    the `scipy-openblas64` / `scipy-openblas32` pip wheels
  system   Debian's libopenblas0-pthread (or whatever `ldconfig` finds)
  bundled  none: mlx keeps its own BLAS
  /a/path  that library
numpy comes first because every decode host has it (the agents need numpy), so
`pip install` alone gives the fast path, and it measured as fast as Debian's
0.3.21 here (7.2 vs 7.3 ms for a SmolLM2 step's matmuls at one row, 8.4 vs 8.7
at 16: docs/performance.md); the system library is the fallback for a
numpy built against something else.

numpy's and the wheels' OpenBLAS are built with 64-bit integers and prefixed
names (`scipy_cblas_sgemm64_`); the library's own `openblas_get_config()` says
which (USE64BITINT), so the shim calls each kind with its own prototype. The
thread count is OpenBLAS's own: OPENBLAS_NUM_THREADS if set, else every core.

Linux only, and only when OpenBLAS and a C compiler are there; otherwise mlx
keeps its own BLAS (correct, slower). Importing this module does it
(`preload()`), so what runs mlx imports it before mlx: the decode agent and the
mlx benchmarks. The CLI and the control plane never import it, and never
compile or load the shim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEM_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
# (prefix, suffix) of the exported names: reference, scipy-openblas32, numpy / scipy-openblas64,
# Debian's libopenblas64.
NAMINGS = (("", ""), ("scipy_", ""), ("scipy_", "64_"), ("", "64_"))

SHIM_C = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
typedef void (*fn_t)(void);
typedef int64_t i64;
static fn_t s, d, c;
static int ilp64;
/* Bind the three gemms of `path`, named PREFIXcblas_Xgemm SUFFIX; 0 when all are there. */
int disagg_blas_bind(const char *path, const char *prefix, const char *suffix, int wide) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    char name[96];
    fn_t f[3];
    const char *x = "sdc";
    if (!h) return 1;
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "%scblas_%cgemm%s", prefix, x[i], suffix);
        if (!(f[i] = (fn_t)dlsym(h, name))) return 2;
    }
    s = f[0], d = f[1], c = f[2], ilp64 = wide;
    return 0;
}
/* mlx's calls take int; a 64-bit-integer OpenBLAS takes int64_t (enums stay int). */
#define GEMM(NAME, F, T, S)                                                                \
void NAME(int o, int ta, int tb, int m, int n, int k, S al, const T *a, int lda,           \
          const T *b, int ldb, S be, T *cc, int ldc) {                                     \
    if (ilp64)                                                                             \
        ((void (*)(int, int, int, i64, i64, i64, S, const T *, i64, const T *, i64, S,     \
                   T *, i64))F)(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc);      \
    else                                                                                   \
        ((void (*)(int, int, int, int, int, int, S, const T *, int, const T *, int, S,     \
                   T *, int))F)(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc);      \
}
GEMM(cblas_sgemm, s, float, float)
GEMM(cblas_dgemm, d, double, double)
GEMM(cblas_cgemm, c, void, const void *)
"""

# What this process ended up with, for status and bench reports: "bundled" or
# "openblas (SOURCE): PATH".
loaded = "bundled"
# OpenBLAS's own description of itself (version, int width, core, threads), "" if bundled.
config = ""
# The bound OpenBLAS's thread-count calls, resolved once (None: mlx's bundled BLAS).
_get_threads: Any = None
_set_threads: Any = None


@dataclass(frozen=True)
class Blas:
    path: str
    prefix: str
    suffix: str
    ilp64: bool  # 64-bit integer arguments
    config: str


def _numpy_libs() -> list[str]:
    """numpy's bundled OpenBLAS, found beside the package without importing numpy."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.origin:
        return []
    libs = Path(spec.origin).parent.parent / "numpy.libs"
    return sorted(glob.glob(str(libs / "libscipy_openblas*.so*")))


def _wheel_libs() -> list[str]:
    """The scipy-openblas64 / scipy-openblas32 wheels' libraries (package dir/lib)."""
    found: list[str] = []
    for pkg in ("scipy_openblas64", "scipy_openblas32"):
        spec = importlib.util.find_spec(pkg)
        for where in (spec.submodule_search_locations or []) if spec else []:
            found += sorted(glob.glob(str(Path(where) / "lib" / "libscipy_openblas*.so")))
    return found


def _system_libs() -> list[str]:
    found = [p for p in SYSTEM_PATHS if Path(p).exists()]
    name = ctypes.util.find_library("openblas")  # a soname; dlopen searches for it
    return found + ([name] if name else [])


SOURCES = {"numpy": _numpy_libs, "wheel": _wheel_libs, "system": _system_libs}


def probe(path: str) -> Blas | None:
    """How `path`'s gemms are named and how wide its integers are; None if it has none
    or cannot load. Opened privately: nothing of it enters the global scope."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    except OSError:
        return None
    for prefix, suffix in NAMINGS:
        if not hasattr(lib, f"{prefix}cblas_sgemm{suffix}"):
            continue
        conf = _call(lib, f"{prefix}openblas_get_config{suffix}", ctypes.c_char_p)
        text = " ".join((conf or b"").decode(errors="replace").split())
        threads = _call(lib, f"{prefix}openblas_get_num_threads{suffix}", ctypes.c_int)
        if threads is not None:
            text += f", threads {threads}"
        # Not OpenBLAS (no config) but a plain cblas_sgemm: the CBLAS standard's int.
        return Blas(path, prefix, suffix, "USE64BITINT" in text.split(), text)
    return None


def _call(lib: ctypes.CDLL, name: str, restype: type) -> Any:
    """`name()` from `lib` if it has it, else None."""
    if not hasattr(lib, name):
        return None
    fn = getattr(lib, name)
    fn.restype = restype
    return fn()


def _thread_calls(blas: Blas) -> tuple[Any, Any]:
    """`blas`'s openblas_get_num_threads and openblas_set_num_threads (None where
    it has none), from the handle the shim opened."""
    lib = ctypes.CDLL(blas.path, mode=os.RTLD_LOCAL)  # opened already: the same handle
    get = getattr(lib, f"{blas.prefix}openblas_get_num_threads{blas.suffix}", None)
    put = getattr(lib, f"{blas.prefix}openblas_set_num_threads{blas.suffix}", None)
    if get is not None:
        get.restype = ctypes.c_int
    if put is not None:
        put.argtypes = [ctypes.c_int]
    return get, put


def threads() -> int | None:
    """How many threads the bound OpenBLAS uses now; None under mlx's own BLAS."""
    return None if _get_threads is None else int(_get_threads())


def set_threads(n: int) -> None:
    """Use `n` threads from the next call on (at most the pool OpenBLAS started
    with). Not safe during a BLAS call: call it from the thread that runs mlx."""
    if _set_threads is not None:
        _set_threads(max(1, n))


def candidates(choice: str) -> list[tuple[str, str]]:
    """(source, path) to try in order for a DISAGG_BLAS value."""
    if choice == "auto":
        return [(src, p) for src in ("numpy", "wheel", "system") for p in SOURCES[src]()]
    if choice in SOURCES:
        return [(choice, p) for p in SOURCES[choice]()]
    return [("DISAGG_BLAS", choice)]


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


def _bind(shim: Path, blas: Blas) -> bool:
    """Bind the shim privately, then make it global: a shim that failed to bind never
    enters the global scope, so mlx never calls a gemm that is not there."""
    local = ctypes.CDLL(str(shim), mode=os.RTLD_LOCAL)
    bind = local.disagg_blas_bind
    bind.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    if bind(blas.path.encode(), blas.prefix.encode(), blas.suffix.encode(), int(blas.ilp64)):
        return False
    ctypes.CDLL(str(shim), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)  # promote the loaded copy
    return True


def preload() -> str:
    """Route mlx's matmuls to OpenBLAS if this is Linux and it can be done.
    Must run before mlx is imported; afterwards it changes nothing."""
    global loaded, config, _get_threads, _set_threads
    choice = os.environ.get("DISAGG_BLAS", "auto") or "auto"
    if sys.platform != "linux" or choice == "bundled" or "mlx.core" in sys.modules:
        return loaded
    if loaded != "bundled":
        return loaded  # already bound: the shim binds once per process
    try:
        for source, path in candidates(choice):
            blas = probe(path)
            if blas is None:
                continue
            shim = _shim()
            if shim is not None and _bind(shim, blas):
                loaded, config = f"openblas ({source}): {path}", blas.config
                _get_threads, _set_threads = _thread_calls(blas)
            return loaded
    except (OSError, subprocess.SubprocessError):
        pass  # a broken install only costs speed, never correctness
    if choice != "auto":  # asked for by name: say why it is not there
        why = "no loadable CBLAS there, or no C compiler for the shim"
        print(f"DISAGG_BLAS={choice}: not used ({why}); mlx keeps its own BLAS", file=sys.stderr)
    return loaded


preload()

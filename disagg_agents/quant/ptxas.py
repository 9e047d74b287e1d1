"""Which ptxas Triton runs for the Spark's sm_121a: Triton 3.5 ships a ptxas (CUDA
12.8) that rejects it (triton issue 8539); TRITON_PTXAS_PATH (and, from Triton 3.6,
TRITON_PTXAS_BLACKWELL_PATH, which newer Triton runs for arch >= 90) name another."""

from __future__ import annotations

import importlib.util
import os

PTXAS_ENVS = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")


def ptxas_version(path: str) -> tuple[int, int] | None:
    """(major, minor) of a ptxas binary's CUDA release, or None if it does not run."""
    import re
    import subprocess

    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else None


def ptxas_for(
    capability: tuple[int, int], candidates: tuple[str, ...] = (), bundled: str | None = None
) -> str | None:
    """On sm_12x (the Spark), where no TRITON_PTXAS*_PATH is set and no ptxas Triton
    ships knows sm_121a (CUDA 12.9 was the first; Triton 3.5 ships 12.8), point both
    variables at the first of `candidates` (default: $CUDA_HOME, /usr/local/cuda)
    that does. Returns the line to log, or None (nothing needed, or nothing found:
    the compile then fails and the layers fall back, saying why)."""
    if capability[0] < 12 or any(os.environ.get(v) for v in PTXAS_ENVS):
        return None
    if bundled is None:  # the ptxas binaries Triton ships
        spec = importlib.util.find_spec("triton")
        if spec is None or spec.origin is None:
            return None
        bundled = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin")
    found = [ptxas_version(os.path.join(bundled, n)) for n in ("ptxas-blackwell", "ptxas")]
    if all(v >= (12, 9) for v in found if v is not None) and any(found):
        return None
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for path in candidates or (os.path.join(cuda, "bin", "ptxas"), "/usr/local/cuda/bin/ptxas"):
        v = ptxas_version(path)
        if v is not None and v >= (12, 9):
            for var in PTXAS_ENVS:
                os.environ[var] = path
            arch = f"sm_{capability[0]}{capability[1]}a"
            return (f"MoE: Triton's own ptxas does not know {arch}; using {path} "
                    f"(CUDA {v[0]}.{v[1]}) via {' and '.join(PTXAS_ENVS)}")  # fmt: skip
    return None

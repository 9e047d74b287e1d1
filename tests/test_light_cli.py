"""The CLI's help and the control plane's modules never compile or load mlx's BLAS
shim (agents/runtime/fastblas.py), nor mlx: only what runs mlx imports them."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import contextlib, io, json, sys
from disagg.cli import main
for argv in (["--help"], ["status", "--help"], ["deploy", "--help"], ["serve", "--help"]):
    sys.argv = ["disagg", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main()
import disagg.api, disagg.fleet.deploy, disagg.fleet.operations, disagg.frontends.app
print(json.dumps({m: m in sys.modules for m in ("agents.runtime.fastblas", "mlx.core", "torch")}))
"""


def test_help_and_control_plane_load_no_blas_shim_nor_mlx() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {"agents.runtime.fastblas": False, "mlx.core": False, "torch": False}


def test_the_decode_agent_loads_the_shim_before_mlx() -> None:
    probe = (
        "import sys, agents.decode.agent; m = list(sys.modules); "
        "print(m.index('agents.runtime.fastblas') < m.index('mlx.core'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "True"

"""The CLI's help and the control plane's modules never compile or load mlx's BLAS
shim (disagg_agents/runtime/fastblas.py), nor mlx: only what runs mlx imports them; and
the decode agent, which runs mlx, never imports torch. Each in a fresh Python."""

from __future__ import annotations

import json

from tests.conftest import PythonProcess

PROBE = """
import contextlib, io, json, sys
from disagg.cli import main
for argv in (["--help"], ["status", "--help"], ["deploy", "--help"], ["serve", "--help"]):
    sys.argv = ["disagg", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main()
import disagg.api, disagg.fleet.deploy, disagg.fleet.operations, disagg.frontends.app
mods = ("disagg_agents.runtime.fastblas", "mlx.core", "torch")
print(json.dumps({m: m in sys.modules for m in mods}))
"""


def test_help_and_control_plane_load_no_blas_shim_nor_mlx(python_process: PythonProcess) -> None:
    done = python_process("-c", PROBE, timeout=120, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {"disagg_agents.runtime.fastblas": False, "mlx.core": False, "torch": False}


def test_the_decode_agent_loads_the_shim_before_mlx(python_process: PythonProcess) -> None:
    probe = (
        "import sys, disagg_agents.decode.agent; m = list(sys.modules); "
        "print(m.index('disagg_agents.runtime.fastblas') < m.index('mlx.core'))"
    )
    done = python_process("-c", probe, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "True"


DECODE_START = """
import runpy, sys
sys.argv = ["disagg_agents.decode", "--help"]  # every import of a start, then argparse exits
try:
    runpy.run_module("disagg_agents.decode", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(sys.modules.get("torch") is not None, "mlx_lm" in sys.modules)
"""


def test_the_decode_agent_imports_no_torch(python_process: PythonProcess) -> None:
    # torch is installed here (this machine runs both roles); mlx-lm's tokenizers
    # import transformers, which would import it: seconds of every decode start.
    done = python_process("-c", DECODE_START, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False True"


def test_a_cpu_prefill_engine_imports_no_triton(python_process: PythonProcess) -> None:
    # torch.nn.attention.bias pulls in torch._dynamo and triton (~0.7 s of every
    # prefill start); and triton imported before TRITON_INTERPRET is set keeps its own
    # jit helpers (tl.zeros) compiled, so the interpreted MoE kernel tests then fail.
    probe = "import sys, disagg_agents.prefill.engine; print('triton' in sys.modules)"
    done = python_process("-c", probe, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"

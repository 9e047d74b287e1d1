"""`disagg bench <kind>` as a user runs it: one command per kind, settings checked
before any agent starts, and the serving commands never load a bench module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.test_cli import one_error_line

pytestmark = pytest.mark.slow  # each test starts a Python process

KINDS = (
    "core",
    "wire",
    "serving",
    "hiding",
    "kvquant",
    "quant-weights",
    "prefix",
    "formats",
    "load",
    "stall",
    "integrity",
    "all",
)


def disagg(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return python("-m", "disagg.cli", *args, timeout=timeout, env=env)


def python(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # Run where no inventory.toml lies: a test must never dial the real cluster.
    env = {**os.environ, "COLUMNS": "200", **(env or {})}
    env.pop("DISAGG_INVENTORY", None)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tempfile.gettempdir(),
    )


# `disagg bench KIND --help` for each argv of argv[1] (JSON), in this one process (the
# command line's own entry point, once per argv): each one's exit code and stderr.
HELPS = """
import contextlib, io, json, sys
from disagg.cli import main
codes = {}
for argv in json.loads(sys.argv[1]):
    sys.argv = ["disagg", *argv]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    codes[" ".join(argv)] = [code, err.getvalue()]
print(json.dumps(codes))
"""


def test_every_kind_is_a_command() -> None:
    listed = disagg("bench", "--help")
    assert listed.returncode == 0, listed.stderr
    for kind in KINDS:
        assert f" {kind} " in listed.stdout, kind
    # Each kind's --help, one process for all of them (each a process of its own costs
    # a Python start and the CLI's imports apiece).
    argvs = [["bench", kind, "--help"] for kind in KINDS]
    done = python("-c", HELPS, json.dumps(argvs))
    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(codes) == [" ".join(argv) for argv in argvs]
    for kind in KINDS:
        code, err = codes[f"bench {kind} --help"]
        assert code == 0, (kind, err)


def test_bad_settings_are_one_line_before_any_agent() -> None:
    one_error_line(disagg("bench", "load", "--local", "--sizes", "bogus"), "--sizes", "bogus")
    one_error_line(disagg("bench", "all", "--local", "--load-sizes", "bogus"), "--sizes")
    one_error_line(disagg("bench", "core", "--local", "--repeats", "0"), "--repeats")
    one_error_line(disagg("bench", "wire"), "--local")
    one_error_line(disagg("bench", "integrity", "--layers", "0"), "--layers")


def test_integrity_runs_on_loopback() -> None:
    proc = disagg("bench", "integrity", "--layer-mb", "0.25", "--layers", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kv_bytes"] == 4 * (1 << 18)
    assert report["loopback_none_s"] > 0 and report["loopback_mac_s"] > 0
    shown = disagg("bench", "integrity", "--layer-mb", "0.25", "--layers", "2")
    assert shown.returncode == 0 and "sealed" in shown.stdout, shown.stderr


PROBE = """
import contextlib, io, json, sys
from disagg.cli import main
for argv in (["--help"], ["serve", "--help"], ["generate", "--help"], ["bench", "--help"]):
    sys.argv = ["disagg", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main()
import disagg.api, disagg.frontends.app, disagg.fleet.operations, disagg.serving.router
print(json.dumps(sorted(m for m in sys.modules if m.startswith("disagg.bench"))))
"""


def test_the_cli_and_the_serving_path_load_no_bench_module() -> None:
    # The static walk is in test_layout; this is what a real process loads.
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []

"""scripts/device-cuda.sh runs on a lent GPU machine, rarely: a file or module it names
that was renamed must fail here, in CI, not there after minutes of device time."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

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

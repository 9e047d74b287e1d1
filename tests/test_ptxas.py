"""Which ptxas Triton runs for the Spark (disagg_agents.quant.ptxas), with stand-in
ptxas binaries that print a CUDA release as the real one does."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from disagg_agents.quant import ptxas


def fake_ptxas(path: Path, release: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ptxas.PTXAS_ENVS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("clean_env")
def test_an_old_bundled_ptxas_on_the_spark_is_replaced_by_a_newer_one(tmp_path: Path) -> None:
    bundled = tmp_path / "triton-bin"
    fake_ptxas(bundled / "ptxas", "12.8")  # Triton 3.5's
    old = fake_ptxas(tmp_path / "cuda-12.8" / "ptxas", "12.8")
    new = fake_ptxas(tmp_path / "cuda-13.0" / "ptxas", "13.0")
    assert ptxas.ptxas_version(new) == (13, 0)
    line = ptxas.ptxas_for((12, 1), (old, new), str(bundled))
    assert line is not None and "sm_121a" in line and new in line
    assert all(os.environ[v] == new for v in ptxas.PTXAS_ENVS)


@pytest.mark.usefixtures("clean_env")
def test_nothing_is_set_where_nothing_is_needed(tmp_path: Path) -> None:
    new = fake_ptxas(tmp_path / "cuda" / "ptxas", "13.0")
    assert ptxas.ptxas_for((9, 0), (new,)) is None  # an H200: any ptxas knows sm_90a
    bundled = tmp_path / "old-bin"
    fake_ptxas(bundled / "ptxas", "12.8")
    assert ptxas.ptxas_for((12, 1), (str(tmp_path / "none"),), str(bundled)) is None
    assert not any(os.environ.get(v) for v in ptxas.PTXAS_ENVS)

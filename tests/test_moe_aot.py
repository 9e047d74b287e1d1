"""The MoE kernels compiled ahead of time for the user's Spark (sm_121a) and the H200
(sm_90a) with Triton's own ptxas, no GPU: at the tiles `moe_triton.tiles_for` picks
for 16 / 512 / 2k / 8k tokens of both user models, no register spill and no more
shared memory than the device has. The tile choice itself is a pure function of
numbers: checked here without compiling.

The compiles run in one child process (disagg_agents.quant.moe_aot), once for both
slow tests: the kernels must be imported without TRITON_INTERPRET, which the
interpreted tests set. Triton's cache is a directory of this session's (a compile
served from an older cache would print no ptxas log to parse: then ptxas reruns).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from disagg_agents.models import moetiles as tt
from disagg_agents.models.moetiles import FORM_AFFINE, FORM_MXFP4
from disagg_agents.quant import moe_triton as mt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def aot(*args: str, cache: str) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache
    out = subprocess.run(
        [sys.executable, "-m", "disagg_agents.quant.moe_aot", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


# One launch of the tiles before the table that spilled on sm_121a (gpt-oss MXFP4
# gate/up at 2k tokens: 128x128x64, 8 warps, 3 stages).
BEFORE = "121:gpt-oss-120b-mxfp4:2048:gate_up"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return aot("--recording", BEFORE, cache=str(tmp_path_factory.mktemp("triton")))


@pytest.mark.slow  # ~25 compiles for two archs (~30 s on 2 free cores), shared with the next
def test_every_kernel_compiles_for_sm121a_and_sm90a_without_spills(
    reports: list[dict[str, Any]],
) -> None:
    reports = [r for r in reports if r["table"]]
    seen = {(r["arch"], r["model"], r["kernel"], t) for r in reports for t in r["tokens"]}
    for arch in (121, 90):
        for model in ("qwen3-coder-30b-a3b-4bit", "gpt-oss-120b-mxfp4"):
            for kernel in tt.KERNELS:
                for tokens in (16, 512, 2048, 8192):
                    assert (arch, model, kernel, tokens) in seen
    bad = [r for r in reports if r["spill_stores"] or r["spill_loads"]]
    assert not bad, bad
    over = [r for r in reports if not 0 < r["shared"] <= r["shared_limit"]]
    assert not over, over
    assert all(0 < r["registers"] <= 255 for r in reports)


@pytest.mark.slow  # one more compile, in the same child process as the table's
def test_the_tiles_before_this_table_spill_on_the_spark(reports: list[dict[str, Any]]) -> None:
    """The check can fail: 128x128x64, 8 warps, 3 stages (every arch's tiles before)
    spill registers on sm_121a for gpt-oss' fused gate/up."""
    (before,) = [r for r in reports if not r["table"]]
    assert (before["arch"], before["model"], before["kernel"]) == (121, "gpt-oss-120b-mxfp4",
                                                                    "gate_up")  # fmt: skip
    assert before["tiles"] == "128x128x64 w8 s3" and before["tokens"] == [2048]
    assert before["spill_stores"] > 1000, before


USER = [(2048, 768, FORM_AFFINE, 64, 8), (2880, 2880, FORM_MXFP4, 32, 4)]


@pytest.mark.parametrize("props", [tt.GB10, tt.H200], ids=["gb10", "h200"])
def test_tiles_are_a_pure_function_that_fits_the_devices_shared_memory(
    props: mt.DeviceProps,
) -> None:
    for _, _, form, group, top_k in USER:
        for tokens in (1, 16, 512, 2048, 8192, 65536):
            for kernel in tt.KERNELS:
                t = mt.tiles_for(props, tokens * top_k, 128, kernel, form, group)
                assert t == mt.tiles_for(props, tokens * top_k, 128, kernel, form, group)
                assert mt.smem_estimate(t, kernel) <= props.shared
                assert t.bm in (16, 32, 64, 128) and t.bn % 16 == 0 and t.bk % 16 == 0
    big = mt.tiles_for(props, 8192 * 8, 128, "gate_up", FORM_AFFINE, 64)
    small = mt.tiles_for(props, 16 * 8, 128, "gate_up", FORM_AFFINE, 64)
    assert small.bm < big.bm  # few rows per expert: small blocks, few padded rows
    mx = mt.tiles_for(props, 8192 * 4, 128, "gate_up", FORM_MXFP4, 32)
    assert mx.bk == 32  # one E8M0 scale per row per K tile


def test_a_tile_over_the_sparks_shared_memory_is_clamped() -> None:
    t = mt.Tiles(128, 128, 64, 8, 3)  # ~147 KB estimated for the fused gate/up
    assert mt.smem_estimate(t, "gate_up") > tt.GB10.shared
    got = mt.clamp(t, tt.GB10.shared, "gate_up")
    assert mt.smem_estimate(got, "gate_up") <= tt.GB10.shared
    assert got.stages == 2 and (got.bm, got.bk) == (128, 64)
    assert mt.clamp(t, tt.H200.shared, "gate_up") == t  # fits an H200 as it is


def test_the_tiles_override_is_clamped_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(mt.TILES_ENV, "128,256,64,8,4")
    with caplog.at_level(logging.WARNING, logger="disagg.prefill"):
        got = mt.forced_tiles(tt.GB10, "gate_up")
        again = mt.forced_tiles(tt.GB10, "gate_up")
    assert got is not None and got == again
    assert mt.smem_estimate(got, "gate_up") <= tt.GB10.shared
    lines = [r.getMessage() for r in caplog.records if mt.TILES_ENV in r.getMessage()]
    assert len(lines) == 1 and "101376" in lines[0], lines
    assert mt.forced_tiles(tt.H200, "down") == mt.Tiles(128, 256, 64, 8, 4)  # fits: as given
    monkeypatch.setenv(mt.TILES_ENV, "128,96,64,8,3")
    with pytest.raises(ValueError, match="powers of two"):
        mt.forced_tiles(tt.GB10, "down")

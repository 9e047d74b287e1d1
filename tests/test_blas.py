"""mlx's matmuls run on numpy's OpenBLAS when nothing else is installed: the Linux
mlx wheel's own reference BLAS makes a batched decode step cost as much as each
request alone (disagg_agents/runtime/fastblas.py).

Each case runs in a fresh Python (the shim binds once per process, before mlx loads):
it imports disagg_agents.runtime.fastblas, then mlx, multiplies non-square, transposed and batched
matrices in float32, float64 and complex64 (the shim's sgemm, dgemm and cgemm) and
reports which BLAS it bound. Results are checked against numpy in float64 within the
worst-case rounding bound of a length-k dot product, k * 2^-23 * (|A| @ |B|) for float32:
different BLAS sum in different orders, so mlx's bundled BLAS and OpenBLAS agree to
rounding, not to the bit. Where mlx runs on numpy's own OpenBLAS, a 2-D float32 product
is also bit-identical to numpy's (the same library, kernel and threads): that, and its
absence with DISAGG_BLAS=bundled, is the evidence that mlx's calls really go through it.

"A machine without the system library" is made real where the test runs as root: the
child runs in its own mount namespace with /dev/null bound over every system OpenBLAS
file (the ones fastblas lists and ldconfig knows)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from disagg.cli.render_fleet import status_table
from disagg.fleet.operations import HostProbe
from disagg_agents.wire.status import AgentStatus
from tests.conftest import PairFactory, PythonProcess
from tests.slowprefill import slow_prefill
from tests.tinymodels import shared_tiny

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the shim is for Linux")

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys
import numpy as np
import disagg_agents.runtime.fastblas as fastblas
import mlx.core as mx
from tests.tinymodels import shared_tiny

rng = np.random.default_rng(7)
MX = {np.float32: mx.float32, np.float64: mx.float64, np.complex64: mx.complex64}
def mat(*shape, dtype):
    x = rng.standard_normal(shape)
    if dtype == np.complex64:
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)

cases = []
for dtype in (np.float32, np.float64, np.complex64):
    a, b = mat(37, 300, dtype=dtype), mat(300, 53, dtype=dtype)
    at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)  # stored transposed
    x3, y3 = mat(4, 19, 96, dtype=dtype), mat(4, 96, 23, dtype=dtype)
    w = mat(96, 41, dtype=dtype)
    def m(x):  # mx.array would make float64 float32 unless told
        return mx.array(x, dtype=MX[dtype])
    pairs = {
        "plain": (a, b, m(a) @ m(b)),
        "a transposed": (a, b, m(at).T @ m(b)),
        "b transposed": (a, b, m(a) @ m(bt).T),
        "both transposed": (a, b, m(at).T @ m(bt).T),
        "batched": (x3, y3, m(x3) @ m(y3)),
        "batched by shared": (x3, w, m(x3) @ m(w)),
        "16 rows": (a[:16], b, m(a[:16]) @ m(b)),
    }
    for name, (p, q, got) in pairs.items():
        assert got.dtype == MX[dtype], (name, got.dtype)
        got = np.array(got, copy=True)
        cases.append({
            "case": f"{name} {np.dtype(dtype).name}",
            "dtype": np.dtype(dtype).name,
            "k": p.shape[-1],
            "err": np.abs(got - (p.astype(np.complex128) @ q.astype(np.complex128))).tolist(),
            "scale": (np.abs(p).astype(np.float64) @ np.abs(q).astype(np.float64)).tolist(),
            "same_bits_as_numpy": p.ndim == 2 and bool(np.array_equal(got, p @ q)),
        })
print(json.dumps({"loaded": fastblas.loaded, "config": fastblas.config, "cases": cases}))
"""

EPS = {"float32": 2.0**-23, "complex64": 2.0**-23, "float64": 2.0**-52}


def _numpy_openblas() -> str:
    """numpy's bundled OpenBLAS, found as a user would (beside the package)."""
    libs = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas*"))
    if not libs:
        pytest.skip("this numpy bundles no OpenBLAS (not a wheel from PyPI)")
    return str(libs[0])


def _system_openblas_files(python: PythonProcess) -> list[str]:
    """Every system OpenBLAS file the shim could find, resolved through symlinks."""
    listed = python(
        "-c", "from disagg_agents.runtime import fastblas; print(*fastblas.SYSTEM_PATHS)",
        env={**os.environ, "DISAGG_BLAS": "bundled"}, check=True, cwd=ROOT, timeout=120,
    ).stdout.split()  # fmt: skip
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=60).stdout
    listed += [ln.split("=>")[-1].strip() for ln in cache.splitlines() if "libopenblas" in ln]
    return sorted({os.path.realpath(p) for p in listed if os.path.exists(p)})


def _run(
    python: PythonProcess, blas: str | None, *, hide_system: bool = False, **env: str
) -> dict[str, Any]:
    """PROBE in a fresh interpreter with DISAGG_BLAS=`blas` (unset if None)."""
    child = {k: v for k, v in os.environ.items() if k != "DISAGG_BLAS"} | env
    if blas is not None:
        child["DISAGG_BLAS"] = blas
    prefix: list[str] = []
    if hide_system:
        files = _system_openblas_files(python)
        mounts = " && ".join(f"mount --bind /dev/null '{p}'" for p in files)
        script = f'{mounts or "true"} && exec "$@"'
        prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    done = python("-c", PROBE, prefix=prefix, env=child, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


def _can_hide() -> bool:
    try:
        probe = ["unshare", "-m", "--propagation", "private", "mount", "--bind", "/dev/null",
                 "/dev/null"]  # fmt: skip
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _assert_correct(run: dict[str, Any]) -> None:
    """Every product within k * eps * (|A| @ |B|) of numpy's float64 / complex128."""
    assert len(run["cases"]) == 21
    for c in run["cases"]:
        bound = c["k"] * EPS[c["dtype"]] * np.asarray(c["scale"])
        err = np.asarray(c["err"])
        assert (err <= bound).all(), (c["case"], float((err / bound).max()))


def _float32_2d_same_bits(run: dict[str, Any]) -> list[bool]:
    # Only products numpy computes with the same call (no transpose flag): for a
    # transposed operand numpy multiplies a contiguous copy, mlx passes the flag,
    # and OpenBLAS's SkylakeX kernels sum those in another order (its Haswell
    # ones did not). The transposed cases are checked against float64 instead.
    same_call = ("plain", "16 rows")
    return [c["same_bits_as_numpy"] for c in run["cases"] if c["case"] in
            [f"{n} float32" for n in same_call]]  # fmt: skip


@pytest.fixture(scope="module")
def bundled(python_process: PythonProcess) -> dict[str, Any]:
    return _run(python_process, "bundled")


def test_bundled_is_correct_and_not_numpys(bundled: dict[str, Any]) -> None:
    assert bundled["loaded"] == "bundled" and bundled["config"] == ""
    _assert_correct(bundled)
    # mlx's own BLAS sums in another order: without this the bit-equality below proves nothing.
    assert not all(_float32_2d_same_bits(bundled))


def test_picks_numpys_openblas_on_a_machine_without_the_system_library(
    python_process: PythonProcess,
) -> None:
    if not _can_hide():
        pytest.skip("needs a private mount namespace (root) to hide the system library")
    lib = _numpy_openblas()
    hidden = _run(python_process, "system", hide_system=True)
    assert hidden["loaded"] == "bundled"  # the hiding works: no system OpenBLAS is left
    assert "DISAGG_BLAS=system: not used" in hidden["stderr"]
    run = _run(python_process, None, hide_system=True)
    assert run["loaded"] == f"openblas (numpy): {lib}"
    assert "USE64BITINT" in run["config"].split()  # the 64-bit-integer prototype was bound
    _assert_correct(run)
    assert all(_float32_2d_same_bits(run))


def test_auto_prefers_numpys_openblas(python_process: PythonProcess) -> None:
    lib = _numpy_openblas()
    run = _run(python_process, "auto")
    assert run["loaded"] == f"openblas (numpy): {lib}"
    _assert_correct(run)
    assert all(_float32_2d_same_bits(run))


def test_disagg_blas_path_still_chooses(python_process: PythonProcess) -> None:
    lib = _numpy_openblas()
    run = _run(python_process, lib)
    assert run["loaded"] == f"openblas (DISAGG_BLAS): {lib}"
    _assert_correct(run)
    assert all(_float32_2d_same_bits(run))


def test_disagg_blas_system_binds_the_32_bit_library(python_process: PythonProcess) -> None:
    if not _system_openblas_files(python_process):
        pytest.skip("no system OpenBLAS here (Debian: libopenblas0-pthread; .ci/run installs it)")
    run = _run(python_process, "system")
    assert run["loaded"].startswith("openblas (system): ")
    assert "USE64BITINT" not in run["config"].split()
    _assert_correct(run)


def test_a_path_that_is_no_blas_keeps_mlx_bundled_and_says_so(
    tmp_path: Path, python_process: PythonProcess
) -> None:
    bogus = tmp_path / "libnot.so"
    bogus.write_bytes(b"not an ELF file")
    run = _run(python_process, str(bogus))
    assert run["loaded"] == "bundled"
    assert f"DISAGG_BLAS={bogus}: not used" in run["stderr"]
    _assert_correct(run)


def test_openblas_num_threads_is_respected(python_process: PythonProcess) -> None:
    one = _run(python_process, "numpy", OPENBLAS_NUM_THREADS="1")
    assert one["config"].endswith("threads 1"), one["config"]
    two = _run(python_process, "numpy", OPENBLAS_NUM_THREADS="2")
    assert two["config"].endswith("threads 2") or os.cpu_count() == 1, two["config"]


@pytest.mark.slow
def test_status_says_which_blas_the_decode_agent_runs(agent_pair: PairFactory) -> None:
    if os.environ.get("DISAGG_BLAS", "auto") != "auto":
        pytest.skip("DISAGG_BLAS is set in this environment: the agent follows it")
    _, decode = agent_pair(shared_tiny("llama"))
    st = decode.status()
    assert st["blas"] == f"openblas (numpy): {_numpy_openblas()}"
    typed = AgentStatus.from_json(st)
    assert typed.mistyped == (), typed.mistyped  # a real agent's /status reads whole
    row = HostProbe("localhost", "decode", "healthy", f"127.0.0.1:{decode.port}", typed)
    for width in (80, 240):  # the short table's detail line, and the wide table's column
        console = Console(width=width, record=True, color_system=None)
        console.print(status_table([row], width))
        assert "mlx/Device(cpu, 0), openblas (numpy)" in console.export_text(), width


def test_status_says_why_blas_runs_on_fewer_threads() -> None:
    st = {"backend": "mlx", "device": "Device(cpu, 0)", "blas": "openblas (numpy): /x.so"}
    for threads, why, said in (
        (2, None, None),
        (1, "busy machine", "1 BLAS thread (busy machine)"),
        (2, "prefill", "2 BLAS threads (prefill)"),
    ):
        row = HostProbe(
            "mac", "decode", "healthy", "10.0.0.2:8001",
            AgentStatus.from_json({**st, "blas_threads": threads, "blas_limited_by": why}),
        )  # fmt: skip
        console = Console(width=240, record=True, color_system=None)
        console.print(status_table([row], 240))
        text = console.export_text()
        assert "mlx/Device(cpu, 0), openblas (numpy)" in text
        assert ("BLAS thread" in text) == (said is not None) and (said or "") in text, text


def test_local_agents_split_the_cores_unless_the_user_chose() -> None:
    """A local pair shares one machine: the decode agent's OpenBLAS gives up half
    the cores while a prefill runs beside it, and a user's setting wins."""
    from disagg.serving.localagents import BLAS_SHARED_ENV, TORCH_SHARED_ENV, thread_share
    from disagg_agents.runtime.blasshare import ENV
    from disagg_agents.runtime.torchshare import ENV as TORCH_ENV

    half = str(max(1, (os.cpu_count() or 2) // 2))
    assert (BLAS_SHARED_ENV, TORCH_SHARED_ENV) == (ENV, TORCH_ENV)
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}  # OpenMP threads sleep, not spin, at barriers
    assert thread_share("decode", {}) == {ENV: half, **passive}
    assert thread_share("decode", {"OPENBLAS_NUM_THREADS": "4"}) == passive
    assert thread_share("prefill", {}) == {TORCH_ENV: half, **passive}
    assert thread_share("prefill", {"OMP_NUM_THREADS": "4"}) == passive
    assert thread_share("prefill", {"OMP_WAIT_POLICY": "ACTIVE"}) == {TORCH_ENV: half}


def test_blas_threads_follow_the_prefills(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads drop to `shared` when the first prefill starts and come back when
    the last ends, set in order through the mlx thread's queue."""
    from disagg_agents.runtime import blasshare
    from disagg_agents.runtime.blasshare import BlasShare

    posted: list[int] = []
    monkeypatch.setattr(blasshare.fastblas, "set_threads", posted.append)
    share = BlasShare(lambda fn: fn(), shared=1, full=4)
    with share.prefilling():
        with share.prefilling():
            assert posted == [1]
        assert posted == [1]
    assert posted == [1, 4]
    # No second thread to give up, or mlx's own BLAS: nothing changes.
    for full in (1, None):
        with BlasShare(lambda fn: fn(), shared=1, full=full).prefilling():
            pass
    assert posted == [1, 4]


def test_free_cores_are_what_others_leave_by_the_median_of_a_few_looks() -> None:
    from disagg_agents.runtime.cpubusy import FreeCores, own_running

    free = FreeCores(cores=2)
    assert free.sample(others=2) == 1  # the first look decides at once
    assert free.sample(others=0) == 1  # one quiet instant is not enough
    assert free.sample(others=0) == 2
    many = FreeCores(cores=16)
    assert [many.sample(others=n) for n in (3, 3, 20)] == [13, 13, 13]
    assert FreeCores(cores=2).sample(others=5) == 1  # never below one
    # Linux's /proc: this process runs at least the thread asking.
    assert own_running() >= 1


def test_others_running_reads_proc_stat_less_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from disagg_agents.runtime import cpubusy

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 9\nprocs_blocked 0\n")
    monkeypatch.setattr(cpubusy, "PROC_STAT", stat)
    monkeypatch.setattr(cpubusy, "own_running", lambda: 3)
    assert cpubusy.others_running() == 6
    stat.write_text("procs_running 2\n")  # fewer than its own (read at another instant)
    assert cpubusy.others_running() == 0
    stat.write_text("cpu  1 2 3\n")
    assert cpubusy.others_running() is None
    monkeypatch.setattr(cpubusy, "PROC_STAT", tmp_path / "absent")
    assert cpubusy.others_running() is None  # off Linux


@pytest.mark.slow
def test_a_really_busy_machine_is_seen_busy() -> None:
    """Two processes spinning: the reader counts them by the median of its looks
    (they stay runnable while preempted), and FreeCores gives this process what
    they leave, at least one."""
    from disagg_agents.runtime.cpubusy import FreeCores, others_running

    spinners = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        looks = [others_running() for _ in range(9)]
        free = FreeCores()
        got = [free.sample() for _ in range(5)]
    finally:
        for p in spinners:
            p.kill()
            p.wait(30)
    # One look is an instant: procs_running and this process's own threads are
    # read apart, so a thread of ours waking between them hides a spinner now and
    # then (CI saw [1, 3, 4, 4, 2, 2, ...]). FreeCores decides on the median of its
    # looks for that reason; the median is what must see both spinners.
    assert all(n is not None for n in looks), looks
    assert statistics.median_low(n for n in looks if n is not None) >= 2, looks
    cores = os.cpu_count() or 1
    assert got[-1] == max(1, cores - statistics.median_high(free.samples)) <= max(1, cores - 2)


def test_a_busy_machine_takes_blas_threads_a_quiet_one_gives_them_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between steps the decode agent uses no more OpenBLAS threads than the
    machine's other work leaves, within the share's cap while a prefill runs."""
    from disagg_agents.runtime import blasshare
    from disagg_agents.runtime.blasshare import BlasShare
    from disagg_agents.runtime.cpubusy import FreeCores

    set_to: list[int] = []
    monkeypatch.setattr(blasshare.fastblas, "set_threads", set_to.append)
    others = [0]
    free = FreeCores(cores=4, window=1)
    monkeypatch.setattr(free, "sample", lambda: FreeCores.sample(free, others[0]))
    share = BlasShare(lambda fn: fn(), shared=2, full=4, free=free)
    share.tick()
    assert set_to == [] and share.limited_by is None  # nobody else: all four
    others[0] = 3
    share.tick()  # within SAMPLE_S of the last look: not looked at again
    assert set_to == []
    share.sampled_at = 0.0
    share.tick()
    assert set_to == [1] and share.limited_by == "busy machine"
    others[0] = 1
    with share.prefilling():
        share.sampled_at = 0.0
        share.tick()  # three free, but a prefill beside it: the share's two
        assert set_to == [1, 2] and share.limited_by == "prefill"
    assert set_to == [1, 2, 3] and share.limited_by == "busy machine"
    share.idle()  # nothing to run: every thread back until the next look
    assert set_to == [1, 2, 3, 4] and share.limited_by is None


def test_a_local_pair_gives_up_blas_threads_while_it_prefills(agent_pair: Any) -> None:
    """Real agents: the decode agent's OpenBLAS runs on every core, on half of them
    while its remote prefill runs (stretched to ~1.6 s), and on every core after."""
    import threading
    import time

    from tests.conftest import ask, remote_request

    full, half = os.cpu_count() or 2, max(1, (os.cpu_count() or 2) // 2)
    if "OPENBLAS_NUM_THREADS" in os.environ or half == full:
        pytest.skip("the user fixed OpenBLAS's threads, or one core: nothing to share")
    # test_drain's slow set (two decode agents): one start serves both modules.
    prefill, decode = agent_pair(shared_tiny("qwen3"), n_decode=2, **slow_prefill(0.4))
    if not decode.status()["blas"].startswith("openblas"):
        pytest.skip("no OpenBLAS bound here: mlx's own BLAS has no thread count")
    assert decode.status()["blas_threads"] == full
    assert decode.status()["blas_limited_by"] is None
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=ask(decode, remote_request(prefill))))
    worker.start()
    seen: set[tuple[int, str | None]] = set()
    while worker.is_alive():  # the stream's 4 layers take ~1.6 s; polled every 50 ms
        st = decode.status()
        seen.add((st["blas_threads"], st["blas_limited_by"]))
        time.sleep(0.05)
    worker.join()
    assert box["r"].metrics.method == "disaggregated"
    assert half in {n for n, _ in seen}, seen
    # The count says why it is not all of them (a busy box may say so too).
    assert (half, "prefill") in seen or any(why == "busy machine" for _, why in seen), seen
    deadline = time.monotonic() + 30  # given back on the mlx thread, before its next step
    while decode.status()["blas_threads"] != full and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.status()["blas_threads"] == full


def test_torch_threads_follow_the_requester() -> None:
    """A prefill whose requester decodes beside it runs on the shared count, then
    torch gets every thread back; with nothing to share, nothing changes."""
    import torch

    from disagg_agents.runtime.torchshare import TorchShare

    full = torch.get_num_threads()
    if full < 2:
        pytest.skip("one torch thread: nothing to share")
    share = TorchShare(shared=1, full=full)
    with share.threads(busy=True) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == full
    with share.threads(busy=False) as n:
        assert n == full == torch.get_num_threads()
    with TorchShare(shared=full, full=full).threads(busy=True) as n:
        assert n == full == torch.get_num_threads()


def test_a_local_prefill_gives_up_torch_threads_while_its_requester_decodes(
    agent_pair: Any,
) -> None:
    """Real agents: a prefill asked while another stream decodes on the same machine
    runs on half the cores (its PREFILL says cores_busy); one asked with nothing
    decoding runs on all of them. Both answer the same tokens."""
    import threading
    import time

    from tests.conftest import ask, remote_request

    half = max(1, (os.cpu_count() or 2) // 2)  # what localagents.thread_share gives
    if "OMP_NUM_THREADS" in os.environ:
        pytest.skip("the user fixed torch's threads: nothing to share")
    import torch

    full = torch.get_num_threads()  # torch's default here is the agent's too
    if full <= half:
        pytest.skip(f"torch runs on {full} threads already: nothing to give up")
    prefill, decode = agent_pair(shared_tiny("qwen3"))
    alone = ask(decode, remote_request(prefill))
    assert alone.metrics.prefill_threads == full, alone.metrics
    box: dict[str, Any] = {}
    # Long enough to outlast the second request (checked below: still_decoding), which
    # takes a prefill and 8 steps; the rest of it is waited out.
    long_stream = remote_request(prefill, max_tokens=1000)
    worker = threading.Thread(target=lambda: box.update(r=ask(decode, long_stream)))
    worker.start()
    deadline = time.monotonic() + 60
    while decode.status()["batch"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert decode.status()["batch"] >= 1, "the long stream never started decoding"
    beside = ask(decode, remote_request(prefill))
    still_decoding = worker.is_alive()
    worker.join()
    assert still_decoding, "the long stream ended before the second prefill: no overlap shown"
    assert beside.metrics.prefill_threads == half, beside.metrics
    assert beside.token_ids == alone.token_ids
    assert box["r"].metrics.method == "disaggregated"


def test_local_agents_hand_freed_memory_back_unless_malloc_is_set() -> None:
    from disagg.serving.localagents import MALLOC_ENV, malloc_returns

    assert malloc_returns({}) == MALLOC_ENV
    assert int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]) <= 1 << 20  # a fixed, small threshold
    assert malloc_returns({"MALLOC_ARENA_MAX": "2"}) == {}  # the user's own malloc settings

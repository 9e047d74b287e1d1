"""The MoE kernels compiled ahead of time for a GPU that is not here, at the user's
models' real shapes and the tiles `moe_triton.tiles_for` picks on that GPU's
properties: registers, spills and shared memory, as ptxas reports them.

Recipe (Triton 3.9, the project's venv; no GPU, no CUDA driver):
1. The launch's arguments come from `moe_triton.launch_args` over meta tensors of
   the real shapes (the code the prefill agent launches with). Each is specialized
   as Triton's launcher does (`triton._C.libtriton.native_specialize_impl`: the
   pointer or int type, "D" where 16-divisible, an int equal to 1 a constexpr) into
   `ASTSource(fn, signature, constexprs, attrs)`.
2. `triton.compile(src, target=GPUTarget("cuda", 121, 32))` (or 90, ...) with the
   tiles' num_warps and num_stages. For arch >= 90 Triton runs the ptxas it ships
   as `triton/backends/nvidia/bin/ptxas-blackwell` (CUDA 13.x, which knows
   sm_121a) with `--gpu-name=sm_121a` / `sm_90a`; `compiled.metadata.shared` is the
   shared memory the kernel allocates.
3. Spills: Triton runs its ptxas with `-v`; TRITON_DUMP_PTXAS_LOG=1 prints that
   log, parsed for "Used N registers" and "N bytes spill stores, M bytes spill
   loads". A compile served from Triton's cache prints none: then that ptxas runs
   again on `compiled.asm["ptx"]` with Triton's options.

On a GPU whose own Triton ships an older ptxas (Triton 3.5's rejects sm_121a),
TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH name a CUDA 13 ptxas instead.
Run in a process without TRITON_INTERPRET (the interpreter's kernels do not
compile): `python -m disagg_agents.quant.moe_aot` prints one JSON line per compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..models import moetiles as tt
from . import moe_triton as mt

ARCHS = {121: tt.GB10, 90: tt.H200}
TOKENS = (16, 512, 2048, 8192)


@dataclass(frozen=True)
class Shape:
    kind: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    form: str  # "affine4" (MLX, group 64) or "mxfp4"


USER_MODELS = {
    "qwen3-coder-30b-a3b-4bit": Shape("qwen3_moe", 2048, 768, 128, 8, "affine4"),
    "gpt-oss-120b-mxfp4": Shape("gpt_oss", 2880, 2880, 128, 4, "mxfp4"),
}


@dataclass
class Report:
    model: str
    kernel: str
    arch: int
    tokens: list[int]
    tiles: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    shared_limit: int
    table: bool  # the tiles the table picks (else the recording's, forced)


def _stored(shape: Shape, n: int, k: int) -> mt.Stored:
    e, meta = shape.experts, torch.device("meta")
    data = torch.empty(e, n, k // 2, dtype=torch.uint8, device=meta)
    if shape.form == "mxfp4":
        scales = torch.empty(e, n, k // 32, dtype=torch.uint8, device=meta)
        return mt.Stored(data, scales, scales, tt.FORM_MXFP4, 4, 32)
    scales = torch.empty(e, n, k // 64, dtype=torch.bfloat16, device=meta)
    return mt.Stored(data, scales, scales, tt.FORM_AFFINE, 4, 64)


def launches(
    shape: Shape, props: mt.DeviceProps, tokens: int, forced: mt.Tiles | None = None
) -> dict[str, mt.Launch]:
    """The two launches of one MoE layer at `tokens` tokens on `props`, as
    `moe_triton.forward` makes them, over meta tensors (`forced`: these tiles)."""

    meta, bf16 = torch.device("meta"), torch.bfloat16
    s, e = tokens * shape.top_k, shape.experts
    gate = _stored(shape, shape.inter, shape.hidden)
    down = _stored(shape, shape.hidden, shape.inter)
    gpt = shape.kind == "gpt_oss"
    bias = torch.empty(e, shape.inter, dtype=bf16, device=meta)
    out: dict[str, mt.Launch] = {}
    for kernel, w in (("gate_up", gate), ("down", down)):
        t = forced or mt.tiles_for(props, s, e, kernel, w.form, w.group)
        nb = max(1, (s + e * (t.bm - 1) + t.bm - 1) // t.bm)
        ex, st, en = (torch.empty(nb, dtype=torch.int32, device=meta) for _ in range(3))
        lay = (ex, st, en)
        order = torch.empty(s, dtype=torch.int64, device=meta)
        if kernel == "gate_up":
            x = torch.empty(tokens, shape.hidden, dtype=bf16, device=meta)
            y = torch.empty(s, shape.inter, dtype=bf16, device=meta)
            out[kernel] = mt.launch_args(
                x, w, w, y, lay, t, tokens=order, glu=tt.GLU_GPT_OSS if gpt else tt.GLU_SWIGLU,
                bias=(bias, bias) if gpt else None, row_weights=None, out_rows=None,
                alpha=1.702, limit=7.0,
            )  # fmt: skip
        else:
            x = torch.empty(s, shape.inter, dtype=bf16, device=meta)
            y = torch.empty(s, shape.hidden, dtype=bf16, device=meta)
            rw = torch.empty(s, dtype=torch.float32, device=meta)
            hb = torch.empty(e, shape.hidden, dtype=bf16, device=meta)
            out[kernel] = mt.launch_args(
                x, w, None, y, lay, t, tokens=None, glu=0, bias=(hb, None) if gpt else None,
                row_weights=rw, out_rows=order, alpha=1.702, limit=7.0,
            )  # fmt: skip
    return out


def source(go: mt.Launch) -> Any:
    """The ASTSource Triton's launcher would build for these arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource

    from . import moe_kernels as kk

    fn = kk.moe_gemm_kernel
    names = fn.arg_names
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = dict(go.constexprs)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, arg in enumerate(go.args):
        kind, spec = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[names[i]] = kind
        if kind == "constexpr":
            constexprs[names[i]] = spec
        elif spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in go.constexprs:
        signature[name] = "constexpr"
    return ASTSource(fn, signature, constexprs, attrs)


def parse_ptxas(log: str) -> tuple[int, int, int] | None:
    """(registers, spill store bytes, spill load bytes) from a ptxas -v log."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spill is None:
        return None
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int]:
    """parse_ptxas of Triton's ptxas run again on `ptx`, with Triton's options."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name=sm_{arch}a", src, "-o", src + ".o"]  # fmt: skip
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    got = parse_ptxas(log)
    if got is None:
        raise RuntimeError(f"unexpected ptxas -v output: {log[-400:]}")
    return got


def compile_one(go: mt.Launch, arch: int) -> tuple[int, int, int, int]:
    """(registers, spill stores, spill loads, shared bytes) of one launch on sm_<arch>a:
    from the log of the ptxas run Triton's compile makes (TRITON_DUMP_PTXAS_LOG)."""
    import contextlib
    import io

    import triton
    from triton.backends.compiler import GPUTarget

    opts = {"num_warps": go.warps, "num_stages": go.stages}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        compiled = triton.compile(source(go), target=GPUTarget("cuda", arch, 32), options=opts)
    got = parse_ptxas(printed.getvalue()) or ptxas_report(compiled.asm["ptx"], arch)
    return (*got, int(compiled.metadata.shared))


def _key(go: mt.Launch) -> str:
    """What makes two launches one compile: constexprs, options, specialization."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    spec = [native_specialize_impl(BaseBackend, a, False, True, True) for a in go.args]
    return repr((sorted(go.constexprs.items()), go.warps, go.stages, spec))


@dataclass(frozen=True)
class Case:
    arch: int
    model: str
    tokens: int
    kernel: str
    forced: mt.Tiles | None


def _compile_case(case: Case) -> tuple[int, int, int, int, str]:
    """compile_one for a case rebuilt in this process (a worker's): regs, spills,
    shared, tiles."""
    go = launches(USER_MODELS[case.model], ARCHS[case.arch], case.tokens, case.forced)[case.kernel]
    c = go.constexprs
    return (*compile_one(go, case.arch), f"{c['BM']}x{c['BN']}x{c['BK']} w{go.warps} s{go.stages}")


def recording_case(spec: str) -> Case:
    """ "arch:model:tokens:kernel" at the tiles the recording before the table ran."""
    arch, model, tokens, kernel = spec.split(":")
    shape = USER_MODELS[model]
    pairs = int(tokens) * shape.top_k
    return Case(int(arch), model, int(tokens), kernel, tt.recording_tiles(pairs, shape.experts))


def report_all(
    archs: tuple[int, ...] = tuple(ARCHS),
    models: tuple[str, ...] = tuple(USER_MODELS),
    tokens_list: tuple[int, ...] = TOKENS,
    forced: mt.Tiles | None = None,
    workers: int = 2,
    recorded: tuple[Case, ...] = (),
) -> list[Report]:
    """Every kernel of the models at each token count on each arch, and the
    `recorded` cases at their tiles; a compile per distinct (kernel, tiles,
    specialization), the token counts that share it listed, the compiles spread
    over `workers` processes."""
    from concurrent.futures import ProcessPoolExecutor

    cases: dict[tuple[int, bool, str], list[Case]] = {}
    every = [Case(a, m, n, k, forced) for a in archs for m in models for n in tokens_list
             for k in tt.KERNELS]  # fmt: skip
    for case in (*every, *recorded):
        go = launches(USER_MODELS[case.model], ARCHS[case.arch], case.tokens, case.forced)
        key = (case.arch, case.forced is None, _key(go[case.kernel]))
        cases.setdefault(key, []).append(case)
    firsts = [same[0] for same in cases.values()]
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(firsts)))) as pool:
        results = list(pool.map(_compile_case, firsts))
    out = []
    for same, (regs, st, ld, shared, tiles) in zip(cases.values(), results, strict=True):
        c = same[0]
        out.append(Report(c.model, c.kernel, c.arch, [x.tokens for x in same], tiles, regs, st,
                          ld, shared, ARCHS[c.arch].shared, c.forced is None))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--model", nargs="+", default=list(USER_MODELS), choices=list(USER_MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--tiles", help="bm,bn,bk,warps,stages: these, not the table's")
    ap.add_argument(
        "--recording",
        nargs="*",
        default=[],
        metavar="ARCH:MODEL:TOKENS:KERNEL",
        help="also these launches at the tiles of the recording before the table",
    )
    ap.add_argument("--only-recording", action="store_true", help="those launches alone")
    args = ap.parse_args()
    if os.environ.get(mt.INTERPRET_ENV) == "1":
        sys.exit("moe_aot: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what launches use today
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # the compile's own ptxas -v log, parsed
    forced = mt.Tiles(*(int(v) for v in args.tiles.split(","))) if args.tiles else None
    workers = min(2, os.cpu_count() or 1)
    recorded = tuple(recording_case(c) for c in args.recording)
    archs = () if args.only_recording else tuple(args.arch)
    for r in report_all(archs, tuple(args.model), tuple(args.tokens), forced, workers, recorded):
        print(json.dumps(asdict(r)), flush=True)


if __name__ == "__main__":
    main()

"""One MoE layer at the user's models' real shapes, per kernel path: tok/s, TFLOP/s
and the bytes a minimal-traffic kernel would move, against the device's bandwidth.

Shapes (random weights in the stored forms, random top-k routing):
- qwen3-coder: Qwen3-Coder-30B-A3B, 128 experts x (gate, up 2048->768, down
  768->2048), top-8, MLX affine 4-bit group 64; and the same kept in bf16.
- gpt-oss: gpt-oss-120b, 128 experts x (gate, up 2880->2880, down 2880->2880),
  top-4, OpenAI MXFP4 with biases (gpt-oss's clamped GLU).
Paths: triton (disagg_agents.quant.moe_triton), grouped (torch's grouped_mm over
all experts dequantized per forward), blocked (one expert's weights per 64-row
block). Each forward runs under torch.cuda.set_sync_debug_mode("error"): a host
sync inside the layer fails the run. The triton output is checked against the
blocked path's (relative max error).

Run (a CUDA machine): python -m disagg.bench.moelayer [--tokens 2048 8192] [--json]
With --count (no GPU): the bytes each layer moves on the Triton path, counted from
the grid and tiles for the Spark (GB10) and the H200, against the minimum
(disagg.bench.moetraffic). On a GPU each triton row is followed by its count.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from disagg.bench import moetraffic
from disagg_agents.models import moetiles as tt
from disagg_agents.quant import moe_triton as mt

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-coder-4bit": dict(kind="qwen3_moe", hidden=2048, inter=768, experts=128, top_k=8,
                             form="affine4", group=64),
    "qwen3-coder-bf16": dict(kind="qwen3_moe", hidden=2048, inter=768, experts=128, top_k=8,
                             form="plain", group=0),
    "gpt-oss-mxfp4": dict(kind="gpt_oss", hidden=2880, inter=2880, experts=128, top_k=4,
                          form="mxfp4", group=32),
}  # fmt: skip


@dataclass
class Result:
    shape: str
    path: str
    tokens: int
    ms: float
    tok_s: float
    tflops: float
    min_bytes: int  # packed weights once + activations in and out
    gb_s: float  # min_bytes / time
    rel_err: float | None  # against the blocked path's output
    error: str | None = None


@contextmanager
def sync_errors() -> Iterator[None]:
    import torch

    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def make_layer(spec: dict[str, Any], device: str) -> Any:
    import torch

    from disagg_agents.quant.dequant import Packed, QSpec, e2m1_pairs
    from disagg_agents.quant.modules import PackedExperts

    g = torch.Generator(device="cpu").manual_seed(0)
    e, h, i = spec["experts"], spec["hidden"], spec["inter"]
    bf16 = torch.bfloat16

    def weight(out: int, n_in: int) -> Any:
        if spec["form"] == "plain":
            return (torch.randn(e, out, n_in, generator=g) * 0.02).to(bf16).to(device)
        if spec["form"] == "mxfp4":
            blocks = torch.randint(0, 256, (e, out, n_in // 2), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 123, (e, out, n_in // 32), generator=g, dtype=torch.uint8)
            return Packed(blocks, scales, None, QSpec("mxfp4", 4, 32), n_in, bf16).to(device)
        gs = spec["group"]
        packed = torch.randint(0, 256, (e, out, n_in // 2), generator=g, dtype=torch.uint8)
        scales = torch.rand(e, out, n_in // gs, generator=g) * 0.004
        return Packed(packed, scales, -scales * 7.5, QSpec("affine", 4, gs), n_in, bf16).to(device)

    gate, up, down = weight(i, h), weight(i, h), weight(h, i)
    # The E2M1 table is copied to the device once per process (a sync), not per forward.
    e2m1_pairs(torch.device(device, 0) if device == "cuda" else torch.device(device), bf16)
    biases = None
    if spec["kind"] == "gpt_oss":
        b = [(torch.randn(e, n, generator=g) * 0.01).to(bf16).to(device) for n in (i, i, h)]
        biases = (b[0], b[1], b[2])
    return PackedExperts(spec["kind"], gate, up, down, e, bf16, biases, act=torch.nn.SiLU())


def weight_bytes(layer: Any) -> int:
    from disagg_agents.quant.dequant import Packed

    total = 0
    for w in (layer.gate, layer.up, layer.down):
        total += w.nbytes if isinstance(w, Packed) else w.numel() * w.element_size()
    return total


def time_path(layer: Any, path: str, x: Any, idx: Any, w: Any, repeats: int) -> tuple[float, Any]:
    import torch

    from disagg_agents.quant import moe

    os.environ[moe.GEMM_ENV] = path
    for _ in range(2):  # the first compiles (triton) and warms the allocator
        t0 = time.perf_counter()
        with sync_errors():
            out = layer(x, idx, w)
        torch.cuda.synchronize()
    if time.perf_counter() - t0 > 0.5:  # a slow path: one timed run says enough
        repeats = 1
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with sync_errors():
            out = layer(x, idx, w)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], out


def bench(shape: str, tokens: int, paths: list[str], repeats: int, budget_s: float) -> list[Result]:
    import torch

    spec = SHAPES[shape]
    layer = make_layer(spec, "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(tokens, spec["hidden"], generator=g) * 0.5).to(torch.bfloat16).cuda()
    logits = torch.randn(tokens, spec["experts"], generator=g)
    top, idx = torch.topk(logits.softmax(-1), spec["top_k"], dim=-1)
    w = (top / top.sum(-1, keepdim=True)).to(torch.bfloat16).cuda()
    idx = idx.cuda()
    pairs = tokens * spec["top_k"]
    flops = 2.0 * pairs * 3 * spec["hidden"] * spec["inter"]
    min_bytes = weight_bytes(layer) + 2 * x.numel() * x.element_size()
    outs: dict[str, Any] = {}
    results = []
    for path in paths:
        t0 = time.perf_counter()
        try:
            ms, out = time_path(layer, path, x, idx, w, repeats)
        except Exception as exc:  # a path that cannot run here says why, the rest go on
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            results.append(Result(shape, path, tokens, 0, 0, 0, min_bytes, 0, None, why))
            torch.cuda.empty_cache()
            continue
        outs[path] = out
        results.append(Result(shape, path, tokens, ms, tokens / ms * 1e3, flops / ms / 1e9,
                              min_bytes, min_bytes / ms / 1e6, None))  # fmt: skip
        del out
        torch.cuda.empty_cache()
        if time.perf_counter() - t0 > budget_s:
            break
    ref = outs.get("blocked", outs.get("grouped"))
    for r in results:
        if r.path in outs and ref is not None and r.path != "blocked":
            diff = (outs[r.path].float() - ref.float()).abs().max()
            r.rel_err = float(diff / ref.float().abs().max().clamp(min=1e-6))
    return results


def device_line() -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "capability": list(torch.cuda.get_device_capability(0)),
            "sms": p.multi_processor_count, "memory_gb": round(p.total_memory / 1e9, 1),
            "torch": torch.__version__}  # fmt: skip


def spec_of(shape: str) -> dict[str, Any]:
    return dict(SHAPES[shape], name=shape)


def print_count(c: moetraffic.Counted, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(c)), flush=True)
        return
    mb = 1e6
    print(f"  counted sm_{c.capability[0]}{c.capability[1]} {c.shape:17} {c.tokens:6} "
          f"{c.order:6} {c.total / mb:7.0f} MB = weights {c.weights / mb:.0f} + acts "
          f"{c.acts / mb:.0f} + inter {c.inter / mb:.0f} + pairs {c.pairs_out / mb:.0f} + out "
          f"{c.out / mb:.0f}; min {c.minimum / mb:.0f} MB: {c.ratio:.2f}x (fused floor "
          f"{c.floor_ratio:.2f}x)", flush=True)  # fmt: skip


def count_all(shapes: list[str], tokens: list[int], as_json: bool) -> None:
    for props in (tt.GB10, tt.H200):
        for shape in shapes:
            for n in tokens:
                for before in (True, False):
                    print_count(moetraffic.count(spec_of(shape), props, n, before), as_json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--paths", nargs="+", default=["triton", "grouped", "blocked"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=40.0, help="per shape and size")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--count", action="store_true", help="counted bytes only (no GPU)")
    args = ap.parse_args()
    if args.count:
        count_all(args.shapes, args.tokens, args.json)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("disagg.bench.moelayer needs a CUDA device")
    print(json.dumps(device_line()), flush=True)
    for shape in args.shapes:
        for tokens in args.tokens:
            for r in bench(shape, tokens, args.paths, args.repeats, args.budget_s):
                if args.json:
                    print(json.dumps(asdict(r)), flush=True)
                else:
                    err = f"  err {r.rel_err:.1e}" if r.rel_err is not None else ""
                    print(f"{r.shape:18} {r.path:8} {r.tokens:6} "
                          + (f"{r.ms:9.2f} ms {r.tok_s:10.0f} tok/s {r.tflops:7.1f} TFLOP/s "
                             f"{r.gb_s:7.0f} GB/s{err}" if r.error is None else r.error),
                          flush=True)  # fmt: skip
                if r.path == "triton" and r.error is None:  # what it moved, counted
                    props = mt.device_props(torch.device("cuda"))
                    print_count(moetraffic.count(spec_of(shape), props, tokens), args.json)


if __name__ == "__main__":
    main()

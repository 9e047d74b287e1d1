"""Sweep the fused MoE kernel's tiles on this device and print the table it would
pick: per user model's layer shape and token band (16 / 512 / 2k / 8k tokens), the
fastest of a few candidates (bm, bn, bk, warps, stages; both launches), beside
the table's own pick (gate/up and down) timed the same way. A candidate that does
not compile or run here (shared memory, registers) is reported with its error, and
the sweep goes on.

Run (a CUDA machine): python -m disagg.bench.tilesweep [--json]
`--cpu-smoke`: a tiny layer on the CPU, the kernels interpreted at each candidate
(the override holds there too; the interpreter's table is its own few big tiles).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from disagg.bench.moelayer import SHAPES, make_layer

BANDS = (16, 512, 2048, 8192)
# Today's pick (H200-tuned), vLLM's sm_120 configs, and smaller ones for few rows.
CANDIDATES = (
    "128,128,64,8,3",
    "64,128,64,4,3",
    "64,128,64,4,2",
    "64,64,128,4,3",
    "32,64,64,4,2",
    "16,64,64,4,2",
)
SMOKE_SHAPE = dict(kind="qwen3_moe", hidden=64, inter=64, experts=4, top_k=2,
                   form="affine4", group=32)  # fmt: skip


def _time(layer: Any, x: Any, idx: Any, w: Any, cuda: bool, repeats: int) -> float:
    import torch

    layer(x, idx, w)  # compiles this configuration
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            layer(x, idx, w)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            layer(x, idx, w)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def sweep(spec: dict[str, Any], tokens: int, device: str, candidates: tuple[str, ...],
          repeats: int) -> list[dict[str, Any]]:  # fmt: skip
    """Each candidate's median ms on one layer of `spec` at `tokens` (or its error)."""
    import torch

    from disagg_agents.quant import moe, moe_triton

    layer = make_layer(spec, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = (torch.randn(tokens, spec["hidden"], generator=g) * 0.5).to(dtype).to(device)
    top, idx = torch.topk(torch.randn(tokens, spec["experts"], generator=g), spec["top_k"], -1)
    w = top.softmax(-1).to(dtype).to(device)
    idx = idx.to(device)
    os.environ[moe.GEMM_ENV] = "triton"
    pairs, dev = tokens * spec["top_k"], torch.device(device)
    gate, down = moe_triton.stored(layer.gate), moe_triton.stored(layer.down)
    assert gate is not None and down is not None
    table = "/".join(_fmt(moe_triton.tiles(dev, pairs, spec["experts"], k, sw))
                     for k, sw in (("gate_up", gate), ("down", down)))  # fmt: skip
    rows = []
    for tiles in (*candidates, None):  # None: the table's pick
        if tiles:
            os.environ[moe_triton.TILES_ENV] = tiles
        ran = ""
        try:
            ran = _fmt(moe_triton.tiles(dev, pairs, spec["experts"], "gate_up", gate))
            ms: float | None = _time(layer, x.to(layer.dtype), idx, w, device == "cuda", repeats)
            error = None
        except Exception as exc:  # a candidate this device cannot run: say why, go on
            ms, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        finally:
            os.environ.pop(moe_triton.TILES_ENV, None)
        rows.append({"tokens": tokens, "tiles": tiles or "table", "ran": ran, "ms": ms,
                     "error": error, "now": table})  # fmt: skip
    return rows


def _fmt(t: Any) -> str:
    return f"{t.bm},{t.bn},{t.bk},{t.warps},{t.stages}"


def pick(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest candidate that ran, and the table's pick with its time."""
    ran = [r for r in rows if r["ms"] is not None and r["tiles"] != "table"]
    best = min(ran, key=lambda r: r["ms"]) if ran else None
    now = next((r for r in rows if r["tiles"] == "table"), None)
    return {
        "tokens": rows[0]["tokens"],
        "pick": best["tiles"] if best else None,
        "ms": best["ms"] if best else None,
        "now": rows[0]["now"],
        "now_ms": now["ms"] if now else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-coder-4bit", "gpt-oss-mxfp4"])
    ap.add_argument("--tokens", nargs="+", type=int, default=list(BANDS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny layer, interpreted")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cands: tuple[str, ...] = CANDIDATES
    device, shapes = "cuda", {s: SHAPES[s] for s in args.shapes}
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        device, shapes, cands, args.tokens = "cpu", {"tiny": SMOKE_SHAPE}, CANDIDATES[-2:], [16]
    import torch

    cap = torch.cuda.get_device_capability(0) if device == "cuda" else None
    print(f"tile table for {f'sm_{cap[0]}{cap[1]}' if cap else 'the CPU interpreter'}")
    for name, spec in shapes.items():
        for n in args.tokens:
            rows = sweep(spec, n, device, cands, args.repeats)
            for r in rows:  # what each candidate launched with (the override honoured)
                line = json.dumps({"shape": name, **r}) if args.json else (
                    f"  {r['tiles']:14} ran {r['ran'] or '-':14} "
                    + (f"{r['ms']:.3f} ms" if r["ms"] is not None else str(r["error"])))
                print(line, flush=True)
            p = pick(rows)
            now = f"{p['now_ms']:.3f} ms" if p["now_ms"] is not None else "did not run"
            best = f"{p['pick']} {p['ms']:.3f} ms" if p["pick"] else "none ran"
            print(f"{name:18} {n:6} tokens: pick {best}; today {p['now']} ({now})", flush=True)


if __name__ == "__main__":
    main()

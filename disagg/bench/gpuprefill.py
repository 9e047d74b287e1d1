"""Prefill on an accelerator: load time, prefill tokens/s and device memory for one
dir, with the weights in full precision or kept packed (disagg_agents.quant).

The agents' own engine (PrefillEngine), timed the way the prefill agent runs it:
each layer's K/V is handed to a callback as it is computed (here copied to host
memory, as the agent does before sending). Used on lent GPU machines (docs/performance.md).

Run: python -m disagg.bench.gpuprefill DIR [DIR ...] [--device cuda] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from disagg.bench.quant_weights import checkpoint_bytes


def sync_check(eng: Any, ids: list[int]) -> str:
    """One forward of the model's body (no head, no copy to the host) under
    torch.cuda.set_sync_debug_mode("error"): "none", or the first host sync's error."""
    import torch

    from disagg.bench.moelayer import sync_errors

    t = torch.tensor([ids], device=eng.device)
    try:
        with torch.inference_mode(), sync_errors():
            eng.body(input_ids=t)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:300]
    return "none"


def probe(
    model_dir: Path, device: str, dtype: str, tokens: int, repeats: int, check: bool = False
) -> dict[str, Any]:
    import torch

    from disagg_agents.prefill.engine import PrefillEngine

    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    eng = PrefillEngine(str(model_dir), device=device, dtype=dtype)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    weights = torch.cuda.memory_allocated() if cuda else None
    vocab = int(eng.cfg["vocab_size"])
    ids = [(i * 7919 + 13) % vocab for i in range(tokens)]
    kv_bytes = 0

    def on_layer(kv: Any) -> None:
        nonlocal kv_bytes
        kv_bytes += kv.keys.nbytes + kv.values.nbytes

    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats + 1):  # the first warms kernels and allocators
        kv_bytes = 0
        t = time.perf_counter()
        eng.prefill(ids, on_layer)
        times.append(time.perf_counter() - t)
    prefill_s = statistics.median(times[1:])
    syncs = sync_check(eng, ids) if check and cuda else None
    return {
        "host_syncs_in_forward": syncs,
        "model": str(model_dir),
        "device": eng.device,
        "dtype": eng.dtype,
        "packed_weight_bytes": eng.packed_bytes,
        "tokens": tokens,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_runs_s": times[1:],
        "prefill_tok_s": tokens / prefill_s,
        "kv_bytes": kv_bytes,
        "device_weights_bytes": weights,
        "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "checkpoint_bytes": checkpoint_bytes(model_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sync-check", action="store_true", help="a forward under sync error mode")
    args = ap.parse_args()
    for d in args.dirs:
        r = probe(d, args.device, args.dtype, args.tokens, args.repeats, args.sync_check)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

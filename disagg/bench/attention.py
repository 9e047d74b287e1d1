"""Prefill attention at gpt-oss-120b's shape: the chunked SDPA (disagg_agents.prefill.
attention) against transformers' eager attention, per prompt length: time and the
device memory one layer's attention adds (peak minus before), full and sliding.

Shape: 64 query heads, 8 K/V heads, head dim 64, sinks on every head, sliding
layers with a 128-token window; bf16; batch 1 (what the prefill agent runs).
Each chunked call runs under torch.cuda.set_sync_debug_mode("error").

Run (a CUDA machine): python -m disagg.bench.attention [--tokens 2048 8192 16384 32768]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128


def _time(fn: Any, repeats: int) -> tuple[float, int]:
    """(median ms, peak bytes added) of fn() on the current CUDA device."""
    import torch

    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() - base


def run(n: int, layer: str, impl: str, repeats: int) -> dict[str, Any]:
    import torch

    from disagg.bench.moelayer import sync_errors
    from disagg_agents.prefill.attention import chunked_attention

    g = torch.Generator(device="cuda").manual_seed(n)
    bf16 = torch.bfloat16
    q = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=bf16, generator=g)
    k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=bf16, generator=g)
    v = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=bf16, generator=g)
    sinks = torch.randn(HEADS, device="cuda", dtype=bf16, generator=g)
    window = WINDOW if layer == "sliding" else None
    scale = HEAD_DIM**-0.5

    def chunked() -> Any:
        with sync_errors():
            return chunked_attention(q, k, v, scale, window, sinks)

    def eager() -> Any:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        qpos = torch.arange(n, device="cuda")[:, None]
        kpos = torch.arange(n, device="cuda")[None, :]
        ok = kpos <= qpos
        if window:
            ok &= qpos - kpos < window
        mask = torch.where(ok, 0.0, torch.finfo(bf16).min).to(bf16)[None, None]
        module = torch.nn.Module()
        module.num_key_value_groups = HEADS // KV_HEADS  # type: ignore[assignment]
        module.sinks = torch.nn.Parameter(sinks, requires_grad=False)
        module.training = False
        return eager_attention_forward(module, q, k, v, mask, scaling=scale, dropout=0.0)[0]

    out: dict[str, Any] = {"tokens": n, "layer": layer, "impl": impl}
    try:
        ms, peak = _time(chunked if impl == "chunked" else eager, repeats)
        out |= {"ms": ms, "tok_s": n / ms * 1e3, "peak_gb": peak / 1e9}
        if impl == "eager":  # the chunked output against eager's, [B, q, H, D] both
            want, got = eager().float(), chunked().transpose(1, 2).float()
            out["max_err"] = float((got - want).abs().max() / want.abs().max())
    except torch.OutOfMemoryError:
        out["error"] = "out of memory"
    except RuntimeError as exc:
        out["error"] = str(exc).splitlines()[0][:200]
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--eager-up-to", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("disagg.bench.attention needs a CUDA device")
    for n in args.tokens:
        for layer in ("full", "sliding"):
            for impl in ("chunked", "eager"):
                if impl == "eager" and n > args.eager_up_to:
                    continue
                print(json.dumps(run(n, layer, impl, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

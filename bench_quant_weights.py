"""Benchmark: a quantized checkpoint prefilled on packed weights (agents.quant).

On one quantized dir (default: SmolLM2 affine 4-bit, made by mlx_lm.convert), in one run:
- prefill memory: RSS growth over an idle process with torch loaded, packed vs
  dequantized at load, against the checkpoint's bytes (+ one layer dequantized);
- prefill tok/s, packed vs dequantized at load (each in a fresh process);
- TTFT of a real agent pair: disaggregated vs mlx-lm prefilling the same dir itself;
- greedy agreement of the disaggregated tokens with mlx-lm alone.

`bench_quant_weights(model_dir)` returns the numbers as a dict; the lead wires it
into `disagg bench --quant-weights`. `python bench_quant_weights.py [DIR]` prints JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = (
    "Disaggregated inference runs the prompt on one machine and decodes on another; "
    "the key value cache of every layer streams over a raw TCP socket as soon as it exists. "
)


def _rss() -> int:
    """Anonymous resident bytes: the process' own memory, not the shared library
    code that torch faults in on first use."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def checkpoint_bytes(model_dir: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _probe(model_dir: str, mode: str, tokens: int, repeats: int) -> dict[str, Any]:
    """Runs in a fresh process: load, prefill `tokens` tokens `repeats` times."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from agents.models import load_hf_config
    from agents.prefill import TORCH_DTYPES, PrefillEngine, pick_dtype
    from agents.quant.dequant import Packed
    from agents.quant.loader import hf_config
    from agents.quant.modules import materialize

    # Idle: an agent with its framework ready. The first model built (even on the
    # meta device, no weights) costs a fixed ~90 MB of transformers/torch state.
    start = _rss()
    cfg = load_hf_config(model_dir)
    dtype = TORCH_DTYPES[pick_dtype("auto", cfg)]
    with torch.device("meta"), no_init_weights():
        AutoModelForCausalLM.from_config(hf_config(cfg, dtype), dtype=dtype)
    gc.collect()
    idle = _rss()
    t0 = time.perf_counter()
    eng = PrefillEngine(model_dir, device="cpu")
    elem = torch.tensor([], dtype=getattr(torch, eng.dtype)).element_size()
    layer0 = [p for m in eng.layers[0].modules() for p in vars(m).values() if isinstance(p, Packed)]
    one_layer = sum(elem * int(torch.Size(p.shape).numel()) for p in layer0)
    made = materialize(eng.model) if mode == "dequantized" else 0
    eng.head = eng.model.get_output_embeddings()
    gc.collect()
    load_s = time.perf_counter() - t0
    loaded = _rss()
    vocab = int(eng.cfg["vocab_size"])
    ids = [(i * 7919 + 13) % vocab for i in range(tokens)]
    times, peak, kv_bytes = [], loaded, 0

    def on_layer(kv: Any) -> None:
        nonlocal peak, kv_bytes
        peak = max(peak, _rss())
        kv_bytes += kv.keys.nbytes + kv.values.nbytes

    for _ in range(repeats + 1):
        kv_bytes = 0
        t = time.perf_counter()
        eng.prefill(ids, on_layer)
        times.append(time.perf_counter() - t)
    prefill_s = statistics.median(times[1:])  # the first warms caches and allocators
    return {
        "mode": mode,
        "framework_rss": idle - start,
        "idle_rss": idle,
        "loaded_rss_growth": loaded - idle,
        "rss_growth": _rss() - idle,
        "peak_rss_growth": peak - idle,  # sampled after each layer of each prefill
        "kv_cache_bytes": kv_bytes,  # the prompt's K/V, held until sent: not weights
        "packed_bytes": eng.packed_bytes,
        "dequantized_bytes": made,
        "one_layer_dequantized_bytes": one_layer,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": tokens / prefill_s,
    }


def probe(model_dir: str | Path, mode: str, tokens: int = 512, repeats: int = 3) -> dict[str, Any]:
    """`_probe` in a child process (so its RSS is this model's alone)."""
    root = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, __file__, "--probe", str(model_dir), mode, str(tokens), str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"probe {mode} failed: {out.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["checkpoint_bytes"] = checkpoint_bytes(model_dir)
    return result


def _agents(model_dir: Path, tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from agents.decode import DecodeEngine
    from disagg.serving import wireclient as client
    from disagg.serving.localagents import start_local_pair

    prefill, decode = start_local_pair(model_dir)
    try:
        eng = DecodeEngine(str(model_dir))
        ids = list(eng.tokenizer.encode(PROMPT * 40))[:tokens]
        prompt = eng.tokenizer.decode(ids)
        base: dict[str, Any] = {
            "prompt": prompt,
            "raw": True,
            "return_prompt_ids": True,
            "prefill": {"host": prefill.host, "port": prefill.port},
        }

        def ttft(placement: str) -> float:
            runs = []
            for _ in range(repeats + 1):
                req = {**base, "max_tokens": 1, "placement": placement}
                res = client.generate(decode.host, decode.port, req, token=decode.token)
                runs.append(float(res.metrics["ttft"]))
            return statistics.median(runs[1:])

        remote, local = ttft("remote"), ttft("local")
        req = {**base, "max_tokens": new_tokens, "ignore_eos": True, "placement": "remote"}
        res = client.generate(decode.host, decode.port, req, token=decode.token)
        steps = generate_step(mx.array(res.prompt_ids or []), eng.model, max_tokens=new_tokens)
        alone = [int(t) for t, _ in steps]
        same = sum(a == b for a, b in zip(res.token_ids, alone, strict=False))
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(res.token_ids, alone, strict=False)) if a != b),
            len(alone),
        )
        return {
            "prompt_tokens": len(res.prompt_ids or []),
            "ttft_disaggregated_s": remote,
            "ttft_mlx_local_s": local,
            "greedy_tokens": len(alone),
            "greedy_agreement": same / max(1, len(alone)),
            "greedy_identical_prefix": first_diff,
            "weights": res.metrics.get("weights"),
        }
    finally:
        decode.stop()
        prefill.stop()


def bench_quant_weights(
    model_dir: str | Path | None = None, tokens: int = 512, new_tokens: int = 64, repeats: int = 3
) -> dict[str, Any]:
    """All the numbers for one quantized dir (default: SmolLM2 4-bit, converted once)."""
    if model_dir is None:
        from tests.quantmodels import quant_dir

        model_dir = quant_dir("smol-affine4")
    model_dir = Path(model_dir)
    packed = probe(model_dir, "packed", tokens, repeats)
    dequant = probe(model_dir, "dequantized", tokens, repeats)
    agents = _agents(model_dir, tokens, new_tokens, repeats)
    ckpt = packed["checkpoint_bytes"]
    budget = 1.25 * ckpt + packed["one_layer_dequantized_bytes"]
    return {
        "model": str(model_dir),
        "checkpoint_bytes": ckpt,
        "packed": packed,
        "dequantized_at_load": dequant,
        "agents": agents,
        "memory_growth_vs_budget": packed["rss_growth"] / budget,
        "packed_vs_dequantized_tok_s": packed["prefill_tok_s"] / dequant["prefill_tok_s"],
        "ttft_vs_transformers_dequantized": agents["ttft_disaggregated_s"] / dequant["prefill_s"],
        "ttft_vs_mlx_local": agents["ttft_disaggregated_s"] / agents["ttft_mlx_local_s"],
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        _, _, d, m, n, r = sys.argv
        print(json.dumps(_probe(d, m, int(n), int(r))))
    else:
        print(json.dumps(bench_quant_weights(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))

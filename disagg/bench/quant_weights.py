"""`disagg bench quant-weights`: a quantized checkpoint prefilled on packed weights.

On one quantized dir (default: SmolLM2 at MLX affine 4-bit, made by mlx_lm.convert),
in one run:
- prefill memory: RSS growth over an idle process with torch loaded, packed vs
  dequantized at load, against the checkpoint's bytes (+ one layer dequantized);
- prefill tok/s, packed vs dequantized at load (each in a fresh process);
- TTFT of a real agent pair (disaggregated) vs transformers prefilling the
  dequantized model, and vs mlx-lm prefilling the same 4-bit dir itself;
- greedy agreement of the disaggregated tokens with mlx-lm alone on the dir.

`run_quant_weights_bench` returns plain data; `quant_weights_table` renders it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from disagg.bench.common import (
    Say,
    Stamp,
    disaggregated,
    local_pair,
    long_text,
    need,
    quiet,
    table,
    verdict,
)
from disagg.errors import AgentError

PROBE_CODE = "from disagg.bench.quant_weights import _probe_main; _probe_main()"


def _rss() -> int:
    """Anonymous resident bytes: the process' own memory, not the shared library
    code torch faults in on first use."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def checkpoint_bytes(model_dir: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _idle_engine_rss(model_dir: str) -> tuple[int, int]:
    """(RSS at start, RSS with the framework ready): the first model built, even on
    the meta device with no weights, costs a fixed ~90 MB of torch/transformers state."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from disagg_agents.models import load_hf_config
    from disagg_agents.prefill.engine import TORCH_DTYPES, pick_dtype
    from disagg_agents.quant.loader import hf_config

    start = _rss()
    cfg = load_hf_config(model_dir)
    dtype = TORCH_DTYPES[pick_dtype("auto", cfg)]
    with torch.device("meta"), no_init_weights():
        AutoModelForCausalLM.from_config(hf_config(cfg, dtype), dtype=dtype)
    gc.collect()
    return start, _rss()


def _probe(model_dir: str, mode: str, tokens: int, repeats: int) -> dict[str, Any]:
    """Runs in a fresh process: load (packed, or dequantized at load), then prefill
    `tokens` tokens `repeats` times (after one warm-up)."""
    import gc

    import torch

    from disagg_agents.prefill.engine import PrefillEngine
    from disagg_agents.quant.dequant import Packed
    from disagg_agents.quant.modules import materialize

    start, idle = _idle_engine_rss(model_dir)
    t0 = time.perf_counter()
    eng = PrefillEngine(model_dir, device="cpu", dequant_budget_gb=0)  # held packed
    elem = torch.tensor([], dtype=getattr(torch, eng.dtype)).element_size()
    layer0 = [p for m in eng.layers[0].modules() for p in vars(m).values() if isinstance(p, Packed)]
    one_layer = sum(elem * int(torch.Size(p.shape).numel()) for p in layer0)
    made = materialize(eng.model) if mode == "dequantized" else 0
    eng.head = eng.model.get_output_embeddings()
    gc.collect()
    load_s, loaded = time.perf_counter() - t0, _rss()
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
        "loaded_rss_growth": loaded - idle,
        "peak_rss_growth": peak - idle,  # sampled after each layer of each prefill
        "kv_cache_bytes": kv_bytes,  # the prompt's K/V, held until sent: not weights
        "packed_bytes": eng.packed_bytes,
        "dequantized_bytes": made,
        "one_layer_dequantized_bytes": one_layer,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": tokens / prefill_s,
    }


def _probe_main() -> None:
    d, mode, n, r = sys.argv[1:5]
    print(json.dumps(_probe(d, mode, int(n), int(r))))


def probe(model_dir: str | Path, mode: str, tokens: int = 512, repeats: int = 3) -> dict[str, Any]:
    """`_probe` in a child process, so its RSS is this model's alone."""
    cmd = [sys.executable, "-c", PROBE_CODE, str(model_dir), mode, str(tokens), str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise AgentError(f"prefill probe ({mode}) failed: {tail}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["checkpoint_bytes"] = checkpoint_bytes(model_dir)
    return result


def agents_part(
    model_dir: Path, tokens: int, mlx_tokens: int, new_tokens: int, repeats: int, say: Say
) -> dict[str, Any]:
    """TTFT of the real pair at `tokens`; at `mlx_tokens` (mlx's quantized matmuls
    on a Linux CPU take minutes at 2k tokens) TTFT disaggregated vs the decode agent
    (mlx-lm) prefilling the same dir itself, and greedy tokens against mlx-lm alone."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from disagg.serving import wireclient
    from disagg_agents.decode.engine import DecodeEngine

    eng = DecodeEngine(str(model_dir))
    long_prompt, short_prompt = (
        long_text(lambda s: len(eng.tokenizer.encode(s)), n) for n in (tokens, mlx_tokens)
    )
    with local_pair(model_dir, say) as (prefill, decode):

        def ttft(prompt: str, placement: str, runs: int, warm: int) -> float:
            times = []
            for _ in range(runs + warm):
                req = {"prompt": prompt, "raw": True, "max_tokens": 1}
                if placement == "remote":
                    res, _ = disaggregated(prefill, decode, req)
                else:
                    req.update(placement="local", prefix_cache=False)
                    res = wireclient.generate(decode.host, decode.port, req, token=decode.token)
                times.append(float(need(res.metrics.ttft)))
            return statistics.median(times[warm:])

        say(f"quant weights: TTFT disaggregated at {tokens} and {mlx_tokens} tokens")
        remote, remote_short = (ttft(p, "remote", repeats, 1) for p in (long_prompt, short_prompt))
        say(f"quant weights: mlx-lm prefilling the 4-bit dir itself ({mlx_tokens} tokens, once)")
        local_short = ttft(short_prompt, "local", 1, 0)
        req = {"prompt": short_prompt, "raw": True, "max_tokens": new_tokens, "ignore_eos": True}
        res, _ = disaggregated(prefill, decode, {**req, "return_prompt_ids": True})
    say("quant weights: mlx-lm alone on the same prompt")
    steps = generate_step(mx.array(res.prompt_ids or []), eng.model, max_tokens=new_tokens)
    alone = [int(t) for t, _ in steps]
    pairs = list(zip(res.token_ids, alone, strict=False))
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(alone))
    return {
        "prompt_tokens": len(eng.tokenizer.encode(long_prompt)),
        "mlx_prompt_tokens": len(res.prompt_ids or []),
        "ttft_disaggregated_s": remote,
        "ttft_disaggregated_short_s": remote_short,
        "ttft_mlx_local_short_s": local_short,
        "greedy_tokens": len(alone),
        "greedy_agreement": sum(a == b for a, b in pairs) / max(1, len(alone)),
        "greedy_identical_prefix": first,
        "weights": res.metrics.weights,
    }


def run_quant_weights_bench(
    model_dir: Path | None = None,
    tokens: int = 2000,
    memory_tokens: int = 128,
    mlx_tokens: int = 256,
    new_tokens: int = 64,
    repeats: int = 3,
    say: Say = quiet,
) -> dict[str, Any]:
    """Every figure for one quantized dir (default: SmolLM2 4-bit, converted once)."""
    from disagg.bench.quantize import default_quantized

    stamp = Stamp()
    model_dir = model_dir or default_quantized(say=say)
    say(f"quant weights: memory of packed vs dequantized-at-load prefill ({memory_tokens} tokens)")
    memory = {m: probe(model_dir, m, memory_tokens, 1) for m in ("packed", "dequantized")}
    say(f"quant weights: prefill speed, packed vs dequantized at load ({tokens} tokens)")
    packed = probe(model_dir, "packed", tokens, repeats)
    dequant = probe(model_dir, "dequantized", tokens, repeats)
    agents = agents_part(model_dir, tokens, mlx_tokens, new_tokens, repeats, say)
    ckpt = packed["checkpoint_bytes"]
    budget = 1.25 * ckpt + packed["one_layer_dequantized_bytes"]
    return {
        "date": stamp.date,
        "load_avg_1m": stamp.load_avg_1m(),
        "elapsed_s": stamp.elapsed_s(),
        "model": str(model_dir),
        "tokens": tokens,
        "memory_tokens": memory_tokens,
        "checkpoint_bytes": ckpt,
        "memory_budget_bytes": budget,
        "memory": memory,
        "packed": packed,
        "dequantized_at_load": dequant,
        "agents": agents,
        # The bar: what the weights cost once loaded, against 1.25x checkpoint + one layer.
        "memory_vs_budget": memory["packed"]["loaded_rss_growth"] / budget,
        "packed_vs_dequantized_tok_s": packed["prefill_tok_s"] / dequant["prefill_tok_s"],
        "ttft_vs_transformers_dequantized": agents["ttft_disaggregated_s"] / dequant["prefill_s"],
        "ttft_vs_mlx_local": agents["ttft_disaggregated_short_s"]
        / agents["ttft_mlx_local_short_s"],
    }


def quant_weights_table(report: dict[str, Any]) -> Table:
    mb = 1e6
    ag = report["agents"]
    t = table(
        f"quantized checkpoint, packed prefill: {Path(report['model']).name}",
        ("measure", "ours", "against", "ratio", "bar", "verdict"),
        left=("measure", "against"),
        caption=(
            f"{report['date']} · checkpoint {report['checkpoint_bytes'] / mb:.1f} MB · memory "
            f"at {report['memory_tokens']} tokens, speed and TTFT at {ag['prompt_tokens']} "
            "tokens · RSS is anonymous memory over an idle agent with torch ready"
        ),
    )
    _memory_rows(t, report)
    _speed_rows(t, report)
    return t


def _memory_rows(t: Table, report: dict[str, Any]) -> None:
    """Prefill memory, packed against the budget and against dequantized at load."""
    mb = 1e6
    mem = report["memory"]
    p, d = mem["packed"], mem["dequantized"]
    t.add_row(
        "prefill RSS after load",
        f"{p['loaded_rss_growth'] / mb:.1f} MB",
        f"budget {report['memory_budget_bytes'] / mb:.1f} MB (dequantized: "
        f"{d['loaded_rss_growth'] / mb:.0f} MB)",
        f"{report['memory_vs_budget']:.2f}",
        "≤ 1.00",
        verdict(report["memory_vs_budget"] <= 1.0),
    )
    t.add_row(
        "prefill RSS peak (incl. K/V)",
        f"{p['peak_rss_growth'] / mb:.1f} MB",
        f"dequantized {d['peak_rss_growth'] / mb:.0f} MB; K/V {p['kv_cache_bytes'] / mb:.1f} MB",
        f"{p['peak_rss_growth'] / d['peak_rss_growth']:.2f}",
        "",
        "",
    )


def _speed_rows(t: Table, report: dict[str, Any]) -> None:
    """Prefill speed, TTFT against transformers and mlx-lm, and greedy agreement."""
    ag = report["agents"]
    speed = report["packed_vs_dequantized_tok_s"]
    t.add_row(
        "prefill tok/s",
        f"{report['packed']['prefill_tok_s']:.0f}",
        f"dequantized at load {report['dequantized_at_load']['prefill_tok_s']:.0f}",
        f"{speed:.2f}",
        "≥ 0.80",
        verdict(speed >= 0.8),
    )
    ttft = report["ttft_vs_transformers_dequantized"]
    t.add_row(
        "TTFT disaggregated",
        f"{ag['ttft_disaggregated_s']:.3f} s",
        f"transformers, dequantized {report['dequantized_at_load']['prefill_s']:.3f} s",
        f"{ttft:.2f}",
        "≤ 1.15",
        verdict(ttft <= 1.15),
    )
    t.add_row(
        f"TTFT disaggregated, {ag['mlx_prompt_tokens']} tokens",
        f"{ag['ttft_disaggregated_short_s']:.3f} s",
        f"mlx-lm prefilling the 4-bit dir {ag['ttft_mlx_local_short_s']:.3f} s",
        f"{report['ttft_vs_mlx_local']:.2f}",
        "",
        "",
    )
    t.add_row(
        f"greedy = mlx-lm alone, {ag['mlx_prompt_tokens']} tokens",
        f"{ag['greedy_identical_prefix']}/{ag['greedy_tokens']}",
        f"weights: {ag['weights']}",
        f"{ag['greedy_agreement']:.0%}",
        "",
        "",
    )

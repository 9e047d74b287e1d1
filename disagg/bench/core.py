"""Benchmark of the core handoff against the monolithic frameworks, in one run
on one machine with one model.

Two questions, each answered by interleaving the agents with the framework
they wrap, in this same process:

* decode speed: does the mlx decode agent (KV streamed in from the torch
  prefill agent) decode as fast as mlx-lm's own `generate_step`?
* TTFT of a long prompt: does the disaggregated first token (client-observed,
  everything in) arrive about as soon as transformers alone finishes prefill?

`run_core_bench` returns plain data (JSON-able); `bench_table` renders it.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.table import Table

from agents import fastblas
from disagg.errors import AgentError
from disagg.units import fmt

Say = Callable[[str], None]

DECODE_BAR = 0.95  # agent decode speed / mlx-lm decode speed, at least
TTFT_BAR = 1.15  # disaggregated TTFT / transformers prefill time, at most
LENGTH_TOLERANCE = 0.03  # the long prompt's token count vs the asked-for count

DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
COLORS = ("red", "green", "blue", "amber", "violet", "grey")


def long_text(count_tokens: Callable[[str], int], target: int) -> str:
    """Deterministic text of about `target` tokens: the longest word prefix that fits."""
    lines = (
        f"Entry {i}: the {COLORS[i % len(COLORS)]} box on shelf {i % 17} "
        f"holds {i * 7 % 31} stones and {i * 11 % 13} coins."
        for i in range(target)  # every line is several tokens: more than enough
    )
    words = ("Here is an inventory.\n" + "\n".join(lines)).split(" ")
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(torch_device: str, mlx_device: str) -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": _version("transformers"),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "mlx_blas": fastblas.loaded,
        "prefill_device": torch_device,
        "decode_device": mlx_device,
    }


def _decode_speed(n: int, t_first: float | None, t_last: float | None) -> float:
    if n < 2 or t_first is None or t_last is None or t_last <= t_first:
        raise AgentError(f"cannot time decode: {n} tokens")
    return (n - 1) / (t_last - t_first)


def run_core_bench(
    model_dir: Path,
    *,
    repeats: int = 3,
    decode_tokens: int = 64,
    long_prompt_tokens: int = 2000,
    say: Say = lambda _msg: None,
) -> dict[str, Any]:
    """Measure the handoff against mlx-lm (decode) and transformers (TTFT).

    Starts a local prefill + decode agent pair, loads the same model in this
    process with mlx-lm and with transformers, runs each comparison `repeats`
    times interleaved (after one warm-up per side) and returns medians, ratios
    and whether the bars hold. mlx never prefills the long prompt here: the
    decode reference only prefills the short chat prompt.
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    if decode_tokens < 2:
        raise ValueError("decode_tokens must be at least 2 (speed is timed between tokens)")
    if long_prompt_tokens < 16:
        raise ValueError("long_prompt_tokens must be at least 16")

    import mlx.core as mx
    import torch
    from mlx_lm import load as mlx_load
    from mlx_lm.generate import generate_step
    from transformers import AutoModelForCausalLM

    from disagg.serving import wireclient as client
    from disagg.serving.localagents import start_local_pair

    model_dir = Path(model_dir)
    t_start = time.perf_counter()
    load_start = _loadavg()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")

    say("starting prefill and decode agents")
    prefill, decode = start_local_pair(model_dir)
    try:
        say("loading mlx-lm and transformers references in this process")
        mlx_model, tokenizer = mlx_load(str(model_dir))[:2]
        hf_model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf_model.eval()
        target = {"host": prefill.host, "port": prefill.port}

        def agent_run(request: dict[str, Any]) -> client.Result:
            # placement "remote": never let the decode agent choose to prefill itself.
            full = {**request, "prefill": target, "placement": "remote"}
            result = client.generate(decode.host, decode.port, full, token=decode.token)
            if result.metrics.get("method") != "disaggregated":
                raise AgentError(
                    "the benchmark request was not disaggregated: "
                    f"{result.metrics.get('fallback_reason') or result.metrics.get('method')}"
                )
            return result

        # ---- decode speed: agent vs mlx-lm's generate_step --------------------------
        decode_req = {
            "prompt": DECODE_PROMPT,
            "max_tokens": decode_tokens,
            "ignore_eos": True,
            "return_prompt_ids": True,
        }

        def mlx_run(ids: list[int], n: int) -> tuple[float, list[int]]:
            out: list[int] = []
            t_first = t_last = None
            for token, _ in generate_step(mx.array(ids), mlx_model, max_tokens=n):
                out.append(int(token))
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
            return _decode_speed(len(out), t_first, t_last), out

        say("decode: warming up both sides")
        warm = agent_run({**decode_req, "max_tokens": min(8, decode_tokens)})
        chat_ids = list(warm.prompt_ids or [])
        if not chat_ids:
            raise AgentError("the decode agent did not return the prompt ids")
        mlx_run(chat_ids, min(8, decode_tokens))

        agent_speeds: list[float] = []
        mlx_speeds: list[float] = []
        same_tokens = True
        for i in range(repeats):
            say(f"decode {i + 1}/{repeats}: agent, then mlx-lm ({decode_tokens} tokens each)")
            res = agent_run(decode_req)
            agent_speeds.append(float(res.metrics["decode_speed"]))
            speed, toks = mlx_run(chat_ids, decode_tokens)
            mlx_speeds.append(speed)
            same_tokens = same_tokens and toks == res.token_ids

        agent_med, mlx_med = _median(agent_speeds), _median(mlx_speeds)
        decode_ratio = agent_med / mlx_med
        decode_part = {
            "prompt_tokens": len(chat_ids),
            "tokens": decode_tokens,
            "agent_tok_s": agent_speeds,
            "mlx_lm_tok_s": mlx_speeds,
            "agent_median_tok_s": agent_med,
            "mlx_lm_median_tok_s": mlx_med,
            "ratio": decode_ratio,
            "bar": DECODE_BAR,
            "ok": decode_ratio >= DECODE_BAR,
            "same_tokens": same_tokens,
        }

        # ---- TTFT of a long prompt: disaggregated vs transformers' own prefill ------
        text = long_text(lambda s: len(tokenizer.encode(s)), long_prompt_tokens)
        long_req = {
            "prompt": text,
            "raw": True,
            "max_tokens": 1,
            "ignore_eos": True,
            "return_prompt_ids": True,
        }

        @torch.inference_mode()
        def hf_prefill(ids: list[int]) -> tuple[float, int]:
            t0 = time.perf_counter()
            out = hf_model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            first = int(out.logits[0, -1].argmax())
            return time.perf_counter() - t0, first

        say(f"ttft: warming up both sides (~{long_prompt_tokens}-token prompt)")
        warm = agent_run(long_req)
        long_ids = list(warm.prompt_ids or [])
        off = abs(len(long_ids) - long_prompt_tokens) / long_prompt_tokens
        if off > LENGTH_TOLERANCE:
            raise AgentError(
                f"the long prompt is {len(long_ids)} tokens, asked for {long_prompt_tokens}"
            )
        hf_prefill(long_ids)

        ttfts: list[float] = []
        hf_times: list[float] = []
        breakdown_runs: list[dict[str, Any]] = []
        same_first = True
        for i in range(repeats):
            say(f"ttft {i + 1}/{repeats}: disaggregated, then transformers")
            res = agent_run(long_req)
            ttfts.append(float(res.metrics["ttft"]))
            breakdown_runs.append(
                {
                    k: res.metrics.get(k)
                    for k in (
                        "agent_ttft",
                        "prefill_time",
                        "kv_wait_time",
                        "kv_transfer_time",
                        "kv_fetch_time",
                        "kv_bytes",
                    )
                }
            )
            secs, first = hf_prefill(long_ids)
            hf_times.append(secs)
            same_first = same_first and res.token_ids[:1] == [first]

        ttft_med, hf_med = _median(ttfts), _median(hf_times)
        ttft_ratio = ttft_med / hf_med
        breakdown: dict[str, Any] = {
            k: _median([float(r[k]) for r in breakdown_runs if r[k] is not None])
            for k in breakdown_runs[0]
            if any(r[k] is not None for r in breakdown_runs)
        }
        if "kv_bytes" in breakdown:
            breakdown["kv_bytes"] = int(breakdown["kv_bytes"])
        ttft_part = {
            "prompt_tokens": len(long_ids),
            "disagg_ttft_s": ttfts,
            "transformers_prefill_s": hf_times,
            "disagg_median_s": ttft_med,
            "transformers_median_s": hf_med,
            "ratio": ttft_ratio,
            "bar": TTFT_BAR,
            "ok": ttft_ratio <= TTFT_BAR,
            "same_first_token": same_first,
            "breakdown": breakdown,
        }

        machine = machine_info(
            torch_device=_agent_device(prefill) or "cpu",
            mlx_device=_agent_device(decode) or str(mx.default_device()),
        )
    finally:
        for agent in (decode, prefill):
            agent.stop()

    return {
        "date": date,
        "model": str(model_dir),
        "settings": {
            "repeats": repeats,
            "decode_tokens": decode_tokens,
            "long_prompt_tokens": long_prompt_tokens,
        },
        "machine": machine,
        "decode": decode_part,
        "ttft": ttft_part,
        # Other work on the machine skews every number: a 1-minute load average
        # well above 0 at either end means the run should be repeated.
        "load_avg_1m": {"start": load_start, "end": _loadavg()},
        "ok": bool(decode_part["ok"] and ttft_part["ok"]),
        "elapsed_s": time.perf_counter() - t_start,
    }


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _agent_device(agent: Any) -> str | None:
    """The device an agent reports on its control endpoint, if it answers (the
    call proves the agent's token, which /status wants)."""
    import json

    from agents.protocol import AuthError

    try:
        return str(json.loads(agent.control("/status"))["device"])
    except (OSError, ValueError, KeyError, TypeError, AuthError):
        return None


def _verdict(ok: bool) -> str:
    return "[green]pass[/]" if ok else "[red]FAIL[/]"


def _num(x: Any, unit: str) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return fmt(x, unit)


def bench_table(report: dict[str, Any]) -> Table:
    """Render `run_core_bench`'s result."""
    d, t, m = report["decode"], report["ttft"], report["machine"]
    table = Table(
        title="disagg core benchmark: agents vs the frameworks they wrap",
        header_style="bold",
        caption=(
            f"{report['date']} · {m['platform']} · {m['cpu_count']} CPUs · "
            f"torch {m['torch']} on {m['prefill_device']} · transformers {m['transformers']} · "
            f"mlx {m['mlx']} / mlx-lm {m['mlx_lm']} on {m['decode_device']} · "
            f"{Path(report['model']).name} · {report['elapsed_s']:.0f} s · load avg (1 min) "
            f"{report['load_avg_1m']['start']} at start, {report['load_avg_1m']['end']} at end"
        ),
    )
    table.add_column("measure")
    table.add_column("median", justify="right")
    table.add_column("runs", justify="right")
    table.add_column("bar", justify="right")

    def runs(xs: list[float], unit: str) -> str:
        return ", ".join(_num(x, unit) for x in xs)

    table.add_section()
    table.add_row(
        f"decode speed, agent ({d['tokens']} tokens, {d['prompt_tokens']}-token chat prompt)",
        _num(d["agent_median_tok_s"], "tok/s"),
        runs(d["agent_tok_s"], "tok/s"),
        "",
    )
    table.add_row(
        "decode speed, mlx-lm generate_step",
        _num(d["mlx_lm_median_tok_s"], "tok/s"),
        runs(d["mlx_lm_tok_s"], "tok/s"),
        "",
    )
    table.add_row(
        "agent / mlx-lm",
        f"{d['ratio']:.3f}",
        "same tokens" if d["same_tokens"] else "[yellow]tokens differ[/]",
        f">= {d['bar']} {_verdict(d['ok'])}",
    )
    table.add_section()
    table.add_row(
        f"TTFT, disaggregated ({t['prompt_tokens']}-token raw prompt, client-observed)",
        _num(t["disagg_median_s"], "s"),
        runs(t["disagg_ttft_s"], "s"),
        "",
    )
    table.add_row(
        "prefill, transformers alone (forward + argmax)",
        _num(t["transformers_median_s"], "s"),
        runs(t["transformers_prefill_s"], "s"),
        "",
    )
    table.add_row(
        "TTFT / transformers prefill",
        f"{t['ratio']:.3f}",
        "same first token" if t["same_first_token"] else "[yellow]first token differs[/]",
        f"<= {t['bar']} {_verdict(t['ok'])}",
    )
    table.add_section()
    units = {"kv_bytes": "B"}
    labels = {
        "agent_ttft": "  decode agent's own TTFT (request in -> first token)",
        "prefill_time": "  prefill agent's forward pass (incl. per-layer KV copies)",
        "kv_wait_time": "  PREFILL sent -> first KV layer in",
        "kv_transfer_time": "  first -> last KV layer in",
        "kv_fetch_time": "  whole KV fetch (dial, handshake, prefill, stream)",
        "kv_bytes": "  KV bytes on the wire",
    }
    for key, label in labels.items():
        if key in t["breakdown"]:
            table.add_row(label, _num(t["breakdown"][key], units.get(key, "s")), "", "")
    return table

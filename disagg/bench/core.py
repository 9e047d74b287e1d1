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

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.table import Table

from disagg.bench.common import (
    DECODE_PROMPT,
    Pair,
    Say,
    Stamp,
    agent_device,
    disaggregated,
    local_pair,
    long_text,
    median,
    need,
    num,
    pair_machine_info,
    quiet,
    table,
    verdict,
)
from disagg.errors import AgentError

DECODE_BAR = 0.95  # agent decode speed / mlx-lm decode speed, at least
TTFT_BAR = 1.15  # disaggregated TTFT / transformers prefill time, at most
LENGTH_TOLERANCE = 0.03  # the long prompt's token count vs the asked-for count
# The decode agent's own timings of a handoff, shown under the TTFT rows.
BREAKDOWN_KEYS = (
    "agent_ttft",
    "prefill_time",
    "kv_wait_time",
    "kv_transfer_time",
    "kv_fetch_time",
    "kv_bytes",
)


def _decode_speed(n: int, t_first: float | None, t_last: float | None) -> float:
    if n < 2 or t_first is None or t_last is None or t_last <= t_first:
        raise AgentError(f"cannot time decode: {n} tokens")
    return (n - 1) / (t_last - t_first)


class References:
    """mlx-lm and transformers on the same weights, in this process."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        import torch
        from mlx_lm import load as mlx_load
        from transformers import AutoModelForCausalLM

        self.mlx_model, self.tokenizer = mlx_load(str(model_dir))[:2]
        # transformers runs where the prefill agent runs (a GPU's TTFT against a CPU's
        # would say nothing about the handoff).
        self.device = device
        hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.hf: Any = hf.to(device).eval()

    def mlx_decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        """mlx-lm's generate_step: decode tokens/s (between the first and last token)
        and the tokens."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        out: list[int] = []
        t_first = t_last = None
        for token, _ in generate_step(mx.array(ids), self.mlx_model, max_tokens=n):
            out.append(int(token))
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
        return _decode_speed(len(out), t_first, t_last), out

    def hf_prefill(self, ids: list[int]) -> tuple[float, int]:
        """transformers' forward pass over `ids` + argmax: seconds and the first token."""
        import torch

        with torch.inference_mode():
            t0 = time.perf_counter()
            ids_t = torch.tensor([ids], device=self.device)
            out = self.hf(input_ids=ids_t, use_cache=True, logits_to_keep=1)
            first = int(out.logits[0, -1].argmax())  # int() waits for the device
            return time.perf_counter() - t0, first


def run_core_bench(
    model_dir: Path,
    *,
    repeats: int = 3,
    decode_tokens: int = 64,
    long_prompt_tokens: int = 2000,
    say: Say = quiet,
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
    model_dir = Path(model_dir)
    stamp = Stamp()
    with local_pair(model_dir, say) as pair:
        say("loading mlx-lm and transformers references in this process")
        refs = References(model_dir, device=agent_device(pair[0]) or "cpu")
        decode_part = decode_compare(pair, refs, repeats, decode_tokens, say)
        ttft_part = ttft_compare(pair, refs, repeats, long_prompt_tokens, say)
        machine = pair_machine_info(*pair)
    return {
        "date": stamp.date,
        "model": str(model_dir),
        "settings": {
            "repeats": repeats,
            "decode_tokens": decode_tokens,
            "long_prompt_tokens": long_prompt_tokens,
        },
        "machine": machine,
        "decode": decode_part,
        "ttft": ttft_part,
        "load_avg_1m": stamp.load_avg_1m(),
        "ok": bool(decode_part["ok"] and ttft_part["ok"]),
        "elapsed_s": stamp.elapsed_s(),
    }


A = TypeVar("A")
B = TypeVar("B")


def interleaved(
    repeats: int, ours: Callable[[], A], ref: Callable[[], B], progress: Callable[[int], None]
) -> tuple[list[A], list[B]]:
    """`repeats` rounds of ours then the reference, so drift on the machine hits both."""
    mine: list[A] = []
    theirs: list[B] = []
    for i in range(repeats):
        progress(i + 1)
        mine.append(ours())
        theirs.append(ref())
    return mine, theirs


def decode_compare(
    pair: Pair, refs: References, repeats: int, tokens: int, say: Say
) -> dict[str, Any]:
    """Decode speed: the agent (KV streamed in) against mlx-lm's generate_step."""
    req = {
        "prompt": DECODE_PROMPT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "return_prompt_ids": True,
    }
    say("decode: warming up both sides")
    warm = disaggregated(*pair, {**req, "max_tokens": min(8, tokens)})[0]
    chat_ids = list(warm.prompt_ids or [])
    if not chat_ids:
        raise AgentError("the decode agent did not return the prompt ids")
    refs.mlx_decode(chat_ids, min(8, tokens))

    agent_runs, mlx_runs = interleaved(
        repeats,
        lambda: disaggregated(*pair, req)[0],
        lambda: refs.mlx_decode(chat_ids, tokens),
        lambda i: say(f"decode {i}/{repeats}: agent, then mlx-lm ({tokens} tokens each)"),
    )
    agent_speeds = [float(need(r.metrics.decode_speed)) for r in agent_runs]
    mlx_speeds = [speed for speed, _ in mlx_runs]
    same_tokens = all(
        r.token_ids == toks for r, (_, toks) in zip(agent_runs, mlx_runs, strict=True)
    )
    return {
        "prompt_tokens": len(chat_ids),
        "tokens": tokens,
        **versus(
            {"agent_tok_s": agent_speeds, "mlx_lm_tok_s": mlx_speeds},
            ("agent_median_tok_s", "mlx_lm_median_tok_s"),
            DECODE_BAR,
            at_least=True,
        ),
        "same_tokens": same_tokens,
    }


def ttft_compare(
    pair: Pair, refs: References, repeats: int, prompt_tokens: int, say: Say
) -> dict[str, Any]:
    """TTFT of a long prompt: disaggregated (client-observed) against transformers'
    own prefill."""
    text = long_text(lambda s: len(refs.tokenizer.encode(s)), prompt_tokens)
    req = {
        "prompt": text,
        "raw": True,
        "max_tokens": 1,
        "ignore_eos": True,
        "return_prompt_ids": True,
    }
    say(f"ttft: warming up both sides (~{prompt_tokens}-token prompt)")
    long_ids = list(disaggregated(*pair, req)[0].prompt_ids or [])
    if abs(len(long_ids) - prompt_tokens) / prompt_tokens > LENGTH_TOLERANCE:
        raise AgentError(f"the long prompt is {len(long_ids)} tokens, asked for {prompt_tokens}")
    refs.hf_prefill(long_ids)

    agent_runs, hf_runs = interleaved(
        repeats,
        lambda: disaggregated(*pair, req)[0],
        lambda: refs.hf_prefill(long_ids),
        lambda i: say(f"ttft {i}/{repeats}: disaggregated, then transformers"),
    )
    ttfts = [float(need(r.metrics.ttft)) for r in agent_runs]
    hf_times = [secs for secs, _ in hf_runs]
    same_first = all(
        r.token_ids[:1] == [first] for r, (_, first) in zip(agent_runs, hf_runs, strict=True)
    )
    runs = [{k: getattr(r.metrics, k) for k in BREAKDOWN_KEYS} for r in agent_runs]
    return {
        "prompt_tokens": len(long_ids),
        **versus(
            {"disagg_ttft_s": ttfts, "transformers_prefill_s": hf_times},
            ("disagg_median_s", "transformers_median_s"),
            TTFT_BAR,
            at_least=False,
        ),
        "same_first_token": same_first,
        "breakdown": breakdown(runs),
    }


def versus(
    runs: dict[str, list[float]], median_keys: tuple[str, str], bar: float, at_least: bool
) -> dict[str, Any]:
    """Both sides' runs (ours first) and medians under their report keys, ours /
    the reference as "ratio", and whether it is `at_least` (or at most) `bar`."""
    ours, ref = (median(xs) for xs in runs.values())
    ratio = ours / ref
    return {
        **runs,
        median_keys[0]: ours,
        median_keys[1]: ref,
        "ratio": ratio,
        "bar": bar,
        "ok": ratio >= bar if at_least else ratio <= bar,
    }


def breakdown(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timing the agents reported in any run; kv_bytes as an int."""
    out: dict[str, Any] = {
        k: median([float(r[k]) for r in runs if r[k] is not None])
        for k in runs[0]
        if any(r[k] is not None for r in runs)
    }
    if "kv_bytes" in out:
        out["kv_bytes"] = int(out["kv_bytes"])
    return out


def bench_table(report: dict[str, Any]) -> Table:
    """Render `run_core_bench`'s result."""
    d, t, m = report["decode"], report["ttft"], report["machine"]
    out = table(
        "disagg core benchmark: agents vs the frameworks they wrap",
        ("measure", "median", "runs", "bar"),
        left=("measure",),
        caption=(
            f"{report['date']} · {m['platform']} · {m['cpu_count']} CPUs · "
            f"torch {m['torch']} on {m['prefill_device']} · transformers {m['transformers']} · "
            f"mlx {m['mlx']} / mlx-lm {m['mlx_lm']} on {m['decode_device']} "
            f"(BLAS: {m.get('decode_blas') or m.get('mlx_blas')}) · "
            f"{Path(report['model']).name} · {report['elapsed_s']:.0f} s · load avg (1 min) "
            f"{report['load_avg_1m']['start']} at start, {report['load_avg_1m']['end']} at end"
        ),
    )
    _compare_rows(
        out,
        "tok/s",
        [
            (
                f"decode speed, agent ({d['tokens']} tokens, "
                f"{d['prompt_tokens']}-token chat prompt)",
                d["agent_median_tok_s"],
                d["agent_tok_s"],
            ),
            ("decode speed, mlx-lm generate_step", d["mlx_lm_median_tok_s"], d["mlx_lm_tok_s"]),
        ],
        (
            "agent / mlx-lm",
            f"{d['ratio']:.3f}",
            "same tokens" if d["same_tokens"] else "[yellow]tokens differ[/]",
            f">= {d['bar']} {verdict(d['ok'])}",
        ),
    )
    _compare_rows(
        out,
        "s",
        [
            (
                f"TTFT, disaggregated ({t['prompt_tokens']}-token raw prompt, client-observed)",
                t["disagg_median_s"],
                t["disagg_ttft_s"],
            ),
            (
                "prefill, transformers alone (forward + argmax)",
                t["transformers_median_s"],
                t["transformers_prefill_s"],
            ),
        ],
        (
            "TTFT / transformers prefill",
            f"{t['ratio']:.3f}",
            "same first token" if t["same_first_token"] else "[yellow]first token differs[/]",
            f"<= {t['bar']} {verdict(t['ok'])}",
        ),
    )
    _breakdown_rows(out, t["breakdown"])
    return out


def _compare_rows(
    table: Table,
    unit: str,
    measured: list[tuple[str, float, list[float]]],
    ratio_row: tuple[str, str, str, str],
) -> None:
    """A section: (label, median, runs) per side, then the ratio row with its bar."""
    table.add_section()
    for label, med, runs in measured:
        table.add_row(label, num(med, unit), ", ".join(num(x, unit) for x in runs), "")
    table.add_row(*ratio_row)


BREAKDOWN_LABELS = {
    "agent_ttft": "  decode agent's own TTFT (request in -> first token)",
    "prefill_time": "  prefill agent's forward pass (incl. per-layer KV copies)",
    "kv_wait_time": "  PREFILL sent -> first KV layer in",
    "kv_transfer_time": "  first -> last KV layer in",
    "kv_fetch_time": "  whole KV fetch (dial, handshake, prefill, stream)",
    "kv_bytes": "  KV bytes on the wire",
}


def _breakdown_rows(table: Table, found: dict[str, Any]) -> None:
    table.add_section()
    for key, label in BREAKDOWN_LABELS.items():
        if key in found:
            table.add_row(label, num(found[key], "B" if key == "kv_bytes" else "s"), "", "")

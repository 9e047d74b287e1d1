"""Prefix reuse on a grader-shaped workload (`disagg bench prefix`).

One long shared prefix (a rubric and reference solution, as the system message)
and several different submissions (the user message), each answered with the
same number of new tokens, greedy, through a real prefill + decode agent pair:
first with the prefix cache off (`prefix_cache: false`), then on. Before each
run one request with the rubric and a short note primes it: with the cache on
it is the miss that fills the caches, so each measured request is what every
submission after the first costs. Measured: mean client TTFT, K/V bytes on the
wire against the suffixes' share (each prompt's positions past the prefix it
shares with the primer), and whether both runs gave the same tokens.

`run_prefix_bench` returns plain data; `prefix_table` renders it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from disagg.bench.common import need
from disagg.serving.defaultmodel import Say
from disagg.units import fmt

if TYPE_CHECKING:
    from disagg.serving.localagents import AgentProc
    from disagg.serving.wireclient import Result

TTFT_BAR = 0.25  # mean TTFT with the cache / without, at most
BYTES_BAR = 1.1  # K/V bytes with the cache / the suffixes' share, at most
COLORS = ("red", "green", "blue", "amber", "violet", "grey")


def fit(count: Callable[[str], int], lines: Callable[[int], str], target: int) -> str:
    """The first k lines of `lines(i)` that make about `target` tokens."""
    text, k = "", 0
    while True:
        more = text + lines(k) + "\n"
        if count(more) > target:
            return text
        text, k = more, k + 1


def rubric_line(i: int) -> str:
    return (
        f"Criterion {i}: award {i % 5 + 1} points if the answer names the "
        f"{COLORS[i % len(COLORS)]} box on shelf {i % 17} and counts {i * 7 % 31} stones."
    )


def submission_line(student: int) -> Callable[[int], str]:
    def line(i: int) -> str:
        return (
            f"Student {student}, step {i}: I opened box {(student * 13 + i * 7) % 97} and "
            f"found {(student + i * 11) % 23} coins under the {COLORS[(student + i) % 6]} lid."
        )

    return line


def run_prefix_bench(
    model_dir: Path | str,
    prefix_tokens: int = 3000,
    suffix_tokens: int = 300,
    requests: int = 16,
    new_tokens: int = 128,
    say: Say = lambda _msg: None,
) -> dict[str, Any]:
    from disagg.serving.localagents import start_local_pair, stop_agents

    model_dir = Path(model_dir)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rubric, subs = _workload(model_dir, prefix_tokens, suffix_tokens, requests)
    say(f"starting prefill and decode agents ({model_dir.name})")
    prefill, decode = start_local_pair(model_dir)
    t0 = time.perf_counter()
    try:
        runs, primer_ids = _cache_off_then_on(prefill, decode, rubric, subs, new_tokens, say)
    finally:
        stop_agents([decode, prefill])

    summary = _summary(runs["off"], runs["on"], primer_ids)
    return {
        "model": str(model_dir),
        "date": date,
        "settings": {
            "prefix_tokens": prefix_tokens,
            "suffix_tokens": suffix_tokens,
            "requests": requests,
            "new_tokens": new_tokens,
        },
        **summary,
        "elapsed_s": time.perf_counter() - t0,
    }


def _workload(
    model_dir: Path, prefix_tokens: int, suffix_tokens: int, requests: int
) -> tuple[str, list[str]]:
    """The rubric (the shared prefix) and the submissions, sized in this model's tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def count(s: str) -> int:
        return len(tok.encode(s))

    rubric = "You grade submissions against this rubric.\n" + fit(count, rubric_line, prefix_tokens)
    return rubric, [fit(count, submission_line(i), suffix_tokens) for i in range(requests)]


def _cache_off_then_on(
    prefill: AgentProc, decode: AgentProc, rubric: str, subs: list[str], new_tokens: int, say: Say
) -> tuple[dict[str, list[Result]], list[int]]:
    """Each run primed, then every submission: the results by run, the primer's ids."""
    from disagg.serving.pair import run_remote
    from disagg_agents.wire.request import GenerateRequest

    def ask(user: str, cache: bool) -> Result:
        req = GenerateRequest(
            messages=[
                {"role": "system", "content": rubric},
                {"role": "user", "content": user},
            ],
            max_tokens=new_tokens,
            ignore_eos=True,
            return_prompt_ids=True,
            prefix_cache=cache,
        )
        return run_remote(prefill, decode, req)

    runs: dict[str, list[Result]] = {}
    primer_ids: list[int] = []
    for name, cache in (("off", False), ("on", True)):
        say(f"cache {name}: priming with the rubric, then {len(subs)} submissions")
        primer = ask("Reply OK when ready.", cache)
        primer_ids = primer.prompt_ids or []
        runs[name] = []
        for i, sub in enumerate(subs):
            runs[name].append(ask(sub, cache))
            say(f"cache {name}: {i + 1}/{len(subs)}, ttft {need(runs[name][-1].metrics.ttft):.3f}s")
    return runs, primer_ids


def _summary(off: list[Any], on: list[Any], primer_ids: list[int]) -> dict[str, Any]:
    """The cache-off and cache-on runs compared: TTFT, K/V bytes, tokens, verdict."""

    def shared(ids: list[int]) -> int:
        n = 0
        while n < min(len(ids), len(primer_ids)) and ids[n] == primer_ids[n]:
            n += 1
        return n

    # Each prompt's share past the shared prefix, of the bytes the cache-off run sent.
    suffix_share = sum(
        r.metrics.kv_bytes
        * (len(r.prompt_ids or []) - shared(r.prompt_ids or []))
        / len(r.prompt_ids or [1])
        for r in off
    )
    ttft_off = statistics.fmean(r.metrics.ttft for r in off)
    ttft_on = statistics.fmean(r.metrics.ttft for r in on)
    bytes_off = sum(int(r.metrics.kv_bytes) for r in off)
    bytes_on = sum(int(r.metrics.kv_bytes) for r in on)
    same = all(a.token_ids == b.token_ids for a, b in zip(off, on, strict=True))
    lengths = [len(r.prompt_ids or []) for r in on]
    ttft_ratio, bytes_ratio = ttft_on / ttft_off, bytes_on / suffix_share
    return {
        "prompt_tokens_mean": statistics.fmean(lengths),
        "shared_tokens": shared(on[0].prompt_ids or []),
        "cached_tokens_mean": statistics.fmean(r.metrics.cached_tokens for r in on),
        "prefill_cached_tokens_mean": statistics.fmean(
            r.metrics.prefill_cached_tokens or 0 for r in on
        ),
        "ttft_off_s": [r.metrics.ttft for r in off],
        "ttft_on_s": [r.metrics.ttft for r in on],
        "ttft_off_mean_s": ttft_off,
        "ttft_on_mean_s": ttft_on,
        "ttft_ratio": ttft_ratio,
        "ttft_bar": TTFT_BAR,
        "kv_bytes_off": bytes_off,
        "kv_bytes_on": bytes_on,
        "kv_bytes_suffix_share": int(suffix_share),
        "kv_bytes_ratio": bytes_ratio,
        "kv_bytes_bar": BYTES_BAR,
        "same_tokens": same,
        "ok": ttft_ratio <= TTFT_BAR and bytes_ratio <= BYTES_BAR and same,
    }


def prefix_table(r: dict[str, Any]) -> Table:
    s = r["settings"]
    table = Table(
        title=(
            f"prefix reuse: {s['requests']} prompts of ~{r['prompt_tokens_mean']:.0f} tokens "
            f"sharing {r['shared_tokens']}, {s['new_tokens']} new tokens each"
        ),
        header_style="bold",
    )
    for col in ("", "cache off", "cache on", "ratio", "bar", "ok"):
        table.add_column(col)

    def ok(good: bool) -> str:
        return "[green]yes[/]" if good else "[red]no[/]"

    table.add_row(
        "mean TTFT",
        fmt(r["ttft_off_mean_s"], "s"),
        fmt(r["ttft_on_mean_s"], "s"),
        f"{r['ttft_ratio']:.3f}",
        f"<= {r['ttft_bar']}",
        ok(r["ttft_ratio"] <= r["ttft_bar"]),
    )
    table.add_row(
        "K/V bytes on the wire",
        f"{r['kv_bytes_off'] / 2**20:,.1f} MiB",
        f"{r['kv_bytes_on'] / 2**20:,.1f} MiB",
        f"{r['kv_bytes_ratio']:.3f} of the suffixes' share",
        f"<= {r['kv_bytes_bar']}",
        ok(r["kv_bytes_ratio"] <= r["kv_bytes_bar"]),
    )
    table.add_row("same greedy tokens", "", "", "", "", ok(r["same_tokens"]))
    table.add_row(
        "cached tokens (decode / prefill)",
        "0",
        f"{r['cached_tokens_mean']:.0f} / {r['prefill_cached_tokens_mean']:.0f}",
        "",
        "",
        "",
    )
    return table

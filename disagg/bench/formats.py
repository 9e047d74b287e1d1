"""Structured outputs' cost (`disagg bench formats`).

Through a real prefill + decode agent pair: decode tokens/s of requests whose
output must follow a JSON Schema against the same requests unconstrained, one
at a time and 16 at once (each of the 16 with its own schema, so 16 grammars
mask 16 rows of one batch); and the decode agent's own time to compile the
grader-style schema (an integer 0-10, an enum and a string) the first time and
on a cache hit (`grammar_ms` in each result's metrics).

`run_formats_bench` returns plain data; `formats_table` renders it.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from disagg.bench.common import Stamp, local_pair, need, pair_machine_info, quiet, table
from disagg.serving.defaultmodel import Say

if TYPE_CHECKING:
    from disagg.serving.localagents import AgentProc
    from disagg.serving.wireclient import Result

SPEED_BAR = 0.9  # constrained decode tok/s / unconstrained, at least
COMPILE_BAR_MS = 50.0  # the grader schema, compiled cold
HIT_BAR_MS = 1.0  # ... and found in the cache ("0 ms")
GRADER = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "verdict": {"enum": ["pass", "fail", "partial"]},
        "reason": {"type": "string"},
    },
    "required": ["score", "verdict", "reason"],
    "additionalProperties": False,
}
PROMPT = (
    "Grade this answer to 'What is the capital of France?': 'Paris, on the Seine.' "
    "Reply in JSON with a score from 0 to 10, a verdict and a long, detailed reason."
)


def long_schema(i: int) -> dict[str, Any]:
    """A grader schema whose reason must be long, so constrained rows decode about
    as many tokens as the unconstrained ones; `i` makes each row's schema its own."""
    s = json.loads(json.dumps(GRADER))
    s["properties"]["reason"] = {"type": "string", "minLength": 200, "maxLength": 300}
    s["properties"]["score"]["maximum"] = 10 + i
    return s


def _speeds(results: list[Any], wall_s: float) -> dict[str, Any]:
    per_row = [r.metrics.decode_speed for r in results if r.metrics.decode_speed]
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "row_tok_s": statistics.fmean(per_row),
        "total_tok_s": tokens / wall_s,
        "tokens_mean": tokens / len(results),
    }


def run_formats_bench(
    model_dir: Path | str,
    new_tokens: int = 64,
    repeats: int = 2,
    say: Say = quiet,
    batches: tuple[int, ...] = (1, 16),
) -> dict[str, Any]:
    stamp = Stamp()
    with local_pair(Path(model_dir), say) as (prefill, decode):
        ask = functools.partial(_ask, prefill, decode, new_tokens)
        # The compile is timed before the first token: one token is all these need.
        compile_only = functools.partial(_ask, prefill, decode, 1)
        say("warming up (the grammar engine reads the tokenizer once)")
        compile_only({"type": "object", "properties": {"warm": {"type": "boolean"}}})
        cold = need(compile_only(GRADER).metrics.grammar_ms)
        hits = [need(compile_only(GRADER).metrics.grammar_ms) for _ in range(5)]
        say(f"grader schema: compile {cold:.2f} ms, cache hit {statistics.median(hits):.3f} ms")
        runs = _batch_runs(ask, repeats, say, batches)
        machine = pair_machine_info(prefill, decode)
    out: dict[str, Any] = {
        "model": str(model_dir),
        "date": stamp.date,
        "machine": machine,
        "load_avg_1m": stamp.load_avg_1m(),
        "settings": {"new_tokens": new_tokens, "repeats": repeats},
        "compile_cold_ms": cold,
        "compile_hit_ms": statistics.median(hits),
        "batches": {},
    }
    ok = cold <= COMPILE_BAR_MS and out["compile_hit_ms"] <= HIT_BAR_MS
    for size, modes in runs.items():
        free = statistics.median(s["row_tok_s"] for s in modes["free"])
        constrained = statistics.median(s["row_tok_s"] for s in modes["json"])
        valid = all(s["valid"] for s in modes["json"])
        out["batches"][size] = {
            "free_tok_s": free,
            "json_tok_s": constrained,
            "ratio": constrained / free,
            "free_total_tok_s": statistics.median(s["total_tok_s"] for s in modes["free"]),
            "json_total_tok_s": statistics.median(s["total_tok_s"] for s in modes["json"]),
            "json_tokens_mean": statistics.fmean(s["tokens_mean"] for s in modes["json"]),
            "all_valid": valid,
        }
        ok = ok and constrained / free >= SPEED_BAR and valid
    out.update(speed_bar=SPEED_BAR, compile_bar_ms=COMPILE_BAR_MS, hit_bar_ms=HIT_BAR_MS)
    out["elapsed_s"] = stamp.elapsed_s()
    out["ok"] = ok
    return out


def _ask(
    prefill: AgentProc,
    decode: AgentProc,
    new_tokens: int,
    schema: dict[str, Any] | None,
    i: int = 0,
) -> Result:
    """One request through the pair: free (exactly `new_tokens`) or held to `schema`."""
    from disagg.serving.checkedrequest import build_request
    from disagg.serving.pair import run_remote

    fields: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"{PROMPT} (answer {i})"}],
        "max_tokens": new_tokens,
        "prefix_cache": False,
    }
    if schema is None:
        fields["ignore_eos"] = True  # exactly new_tokens
    else:  # room to finish the JSON: speeds are rates, lengths may differ
        fields["response_format"] = {"type": "json_schema", "schema": schema}
        fields["max_tokens"] = 4 * new_tokens
    # 16 prompts queue at one prefill agent: allow for the wait.
    req = build_request(**fields)
    return run_remote(prefill, decode, req, timeout_s=1800, prefill_timeout_s=900)


def _batch_runs(
    ask: Callable[..., Result], repeats: int, say: Say, batches: tuple[int, ...]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Speeds per batch size (1, 16 by default), mode (free, json) and repeat."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for batch in batches:
        for name in ("free", "json"):
            runs.setdefault(str(batch), {}).setdefault(name, [])
        for rep in range(repeats):
            for name in ("free", "json"):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(batch) as pool:
                    results = list(
                        pool.map(
                            lambda i, n=name, r=rep: ask(
                                long_schema(i + 100 * r) if n == "json" else None, i
                            ),
                            range(batch),
                        )
                    )
                speeds = _speeds(results, time.perf_counter() - t0)
                if name == "json":  # what the constraint gave is checked, not trusted
                    speeds["valid"] = all(
                        _valid(r.text) and r.metrics.finish_reason == "stop" for r in results
                    )
                runs[str(batch)][name].append(speeds)
                say(
                    f"batch {batch} {name}: {speeds['row_tok_s']:.1f} tok/s per row, "
                    f"{speeds['total_tok_s']:.1f} in all"
                )
    return runs


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def formats_table(r: dict[str, Any]) -> Table:
    t = table(
        f"structured outputs: JSON Schema constraint vs none ({r['settings']['new_tokens']} "
        "new tokens, per-row decode tok/s)",
        ("", "unconstrained", "constrained", "ratio", "bar", "ok"),
        left=("",),
    )

    def ok(good: bool) -> str:
        return "[green]yes[/]" if good else "[red]no[/]"

    for batch, b in r["batches"].items():
        t.add_row(
            f"decode, batch {batch}",
            f"{b['free_tok_s']:.1f} tok/s",
            f"{b['json_tok_s']:.1f} tok/s",
            f"{b['ratio']:.3f}",
            f">= {r['speed_bar']}",
            ok(b["ratio"] >= r["speed_bar"] and b["all_valid"]),
        )
    t.add_row(
        "grader schema compile",
        "",
        f"{r['compile_cold_ms']:.2f} ms",
        "",
        f"<= {r['compile_bar_ms']:g} ms",
        ok(r["compile_cold_ms"] <= r["compile_bar_ms"]),
    )
    t.add_row(
        "... on a cache hit",
        "",
        f"{r['compile_hit_ms']:.3f} ms",
        "",
        f"<= {r['hit_bar_ms']:g} ms",
        ok(r["compile_hit_ms"] <= r["hit_bar_ms"]),
    )
    return t

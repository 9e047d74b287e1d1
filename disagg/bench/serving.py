"""Serving figures of the local agents against the monolithic frameworks.

`run_serving_bench` starts one local prefill + decode agent pair and, in this
process, transformers and mlx-lm on the same weights, then measures:

* latency: TTFT and TPOT at several prompt lengths for disagg (client-observed,
  token arrival times), transformers' `generate` (a streamer stamps each token)
  and mlx-lm's `generate_step` (each yield stamped). mlx-lm prefills slowly on
  a CPU: a length whose projected mlx TTFT (linear in tokens from the longest
  length measured so far) passes `mlx_cap_s` runs in a child process that is
  killed at about `mlx_cap_s` + 60 s (the load's slack), and is then marked capped;
* memory: the decode agent's peak RSS during one handoff of the longest prompt,
  against model + 1.5 x KV: VmHWM is reset through /proc/PID/clear_refs after a
  warm-up request, VmRSS read as the baseline, VmHWM read after the request;
* concurrency: aggregate decode tokens/s of 1, 4 and 16 concurrent requests to
  the one decode agent (continuous batching: they share decode steps). Decode
  tokens/s counts every token after each request's first, over the window from
  the earliest first token to the latest last one (client-observed arrivals);
  end-to-end tokens/s (all tokens over the whole wall time, prefills included)
  is reported beside it.

`ttft_chart` draws TTFT against prompt length per system as a PNG.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from disagg.bench.common import (
    DECODE_PROMPT,
    Pair,
    Say,
    Stamp,
    cell,
    disaggregated,
    local_pair,
    long_text,
    median_or_none,
    need,
    pair_machine_info,
    quiet,
    table,
    verdict,
)

LENGTHS = (128, 1024, 4096)
CONCURRENCY = (1, 4, 16)
MEMORY_BAR = 1.5  # decode agent peak during a handoff <= model + this x KV size
CONCURRENCY_BAR = 4.0  # aggregate tok/s at 16 requests >= this x single stream


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM ... of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key.startswith("Vm") and rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS


def _timing(stamps: list[float], t0: float) -> dict[str, float | None]:
    if not stamps:
        return {"ttft_s": None, "tpot_s": None, "tokens": 0}
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"ttft_s": stamps[0] - t0, "tpot_s": tpot, "tokens": len(stamps)}


class _Stamper:
    """A transformers streamer that stamps each new token's arrival."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True  # generate() first puts the prompt itself
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class Systems:
    """The three systems on the same weights, each timed on one prompt: disagg
    (the local agent pair), and transformers and mlx-lm in this process."""

    def __init__(self, pair: Pair, model_dir: Path, tokens: int) -> None:
        import torch
        from mlx_lm import load as mlx_load
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.pair, self.model_dir, self.tokens = pair, model_dir, tokens
        self.tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
        self.hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.mlx_model = mlx_load(str(model_dir))[0]

    def prompt_for(self, n: int) -> tuple[str, list[int]]:
        text = long_text(lambda s: len(self.tok.encode(s)), n)
        return text, list(self.tok.encode(text))

    def disagg_once(self, text: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        req = {"prompt": text, "raw": True, "max_tokens": self.tokens, "ignore_eos": True}
        res, stamps = disaggregated(*self.pair, req)
        out = _timing(stamps, t0)
        out["kv_bytes"] = res.metrics.kv_bytes
        out["prefill_time"] = res.metrics.prefill_time
        out["first_token"] = res.token_ids[0] if res.token_ids else None
        return out

    def hf_once(self, ids: list[int]) -> dict[str, Any]:
        import torch

        st = _Stamper()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=self.tokens,
                min_new_tokens=self.tokens,
                do_sample=False,
                streamer=st,
                pad_token_id=self.tok.eos_token_id,
            )
        res = _timing(st.stamps, t0)
        res["first_token"] = int(out[0, len(ids)])
        return res

    def mlx_once(self, ids: list[int]) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        stamps: list[float] = []
        first = None
        t0 = time.perf_counter()
        for token, _ in generate_step(mx.array(ids), self.mlx_model, max_tokens=self.tokens):
            stamps.append(time.perf_counter())
            if first is None:
                first = int(token)
        res = _timing(stamps, t0)
        res["first_token"] = first
        return res


def run_serving_bench(
    model_dir: Path,
    *,
    lengths: tuple[int, ...] = LENGTHS,
    tokens: int = 16,
    repeats: int = 2,
    mlx_cap_s: float = 300.0,
    concurrency: tuple[int, ...] = CONCURRENCY,
    concurrency_tokens: int = 128,  # long enough that admission ramps do not dominate
    say: Say = quiet,
) -> dict[str, Any]:
    """Latency per prompt length, decode memory, concurrency; plain data."""
    if tokens < 2 or repeats < 1 or not lengths:
        raise ValueError("tokens >= 2, repeats >= 1, at least one length")
    model_dir = Path(model_dir)
    stamp = Stamp()
    with local_pair(model_dir, say) as pair:
        say("loading transformers and mlx-lm in this process")
        systems = Systems(pair, model_dir, tokens)
        say("warming up the three systems")
        short_text, short_ids = systems.prompt_for(min(lengths))
        systems.disagg_once(short_text)
        systems.hf_once(short_ids)
        systems.mlx_once(short_ids)
        memory = memory_part(systems, max(lengths), say)
        latency = latency_part(systems, lengths, repeats, mlx_cap_s, say)
        conc = concurrency_part(pair, concurrency, concurrency_tokens, say)
        machine = pair_machine_info(*pair)
    last = conc[-1] if conc else None
    return {
        "date": stamp.date,
        "model": str(model_dir),
        "settings": {
            "lengths": list(lengths),
            "tokens": tokens,
            "repeats": repeats,
            "mlx_repeats": 1,
            "mlx_cap_s": mlx_cap_s,
            "concurrency": list(concurrency),
            "concurrency_tokens": concurrency_tokens,
        },
        "machine": machine,
        "latency": latency,
        "memory": memory,
        "concurrency": {
            "runs": conc,
            "bar": CONCURRENCY_BAR,
            "ok": bool(last and last["vs_single"] and last["vs_single"] >= CONCURRENCY_BAR),
            "note": (
                "continuous batching: concurrent requests share decode steps; aggregate = "
                "tokens after each first token / (last token - earliest first token)"
            ),
        },
        "load_avg_1m": stamp.load_avg_1m(),
        "elapsed_s": stamp.elapsed_s(),
    }


def memory_part(systems: Systems, length: int, say: Say) -> dict[str, Any]:
    """The decode agent's peak RSS during one handoff of a `length`-token prompt."""
    text, ids = systems.prompt_for(length)
    say(f"memory: decode agent peak RSS during a {len(ids)}-token handoff")
    pid = systems.pair[1].proc.pid
    memory: dict[str, Any] = {"prompt_tokens": len(ids), "pid": pid}
    try:
        _reset_peak(pid)
        before = _proc_status(pid)
        req = {"prompt": text, "raw": True, "max_tokens": 2, "ignore_eos": True}
        res = disaggregated(*systems.pair, req)[0]
        after = _proc_status(pid)
    except OSError as e:
        memory["error"] = f"cannot read /proc for the decode agent: {e}"
        return memory
    kv = int(need(res.metrics.kv_bytes))
    model_bytes = sum(p.stat().st_size for p in systems.model_dir.glob("*.safetensors"))
    growth = after["VmHWM"] - before["VmRSS"]
    memory.update(
        baseline_rss=before["VmRSS"],
        peak_rss=after["VmHWM"],
        growth=growth,
        kv_bytes=kv,
        model_bytes=model_bytes,
        growth_over_kv=growth / kv,
        bar=MEMORY_BAR,
        # peak <= model + runtime + 1.5 x KV, runtime = what the agent holds
        # besides the weights before the request (python, mlx, tokenizer):
        ok=growth <= MEMORY_BAR * kv,
        # the bar read literally, no runtime allowance:
        ok_literal=after["VmHWM"] <= model_bytes + MEMORY_BAR * kv,
    )
    memory.update(_cache_on_memory(systems, pid, text, kv))
    return memory


def _cache_on_memory(systems: Systems, pid: int, text: str, kv: int) -> dict[str, Any]:
    """The same handoff with the prefix cache on, a prompt it has not seen (a
    miss that stores its blocks): growth, and what of it the cache keeps."""

    def cached_bytes() -> int:
        return int(json.loads(systems.pair[1].control("/status"))["prefix_cache"]["bytes"])

    try:
        stored0 = cached_bytes()
        _reset_peak(pid)
        before = _proc_status(pid)
        req = {"prompt": "Cache on. " + text, "raw": True, "max_tokens": 2, "ignore_eos": True}
        disaggregated(*systems.pair, {**req, "prefix_cache": True})
        after = _proc_status(pid)
        stored = cached_bytes() - stored0
    except (OSError, ValueError, KeyError) as e:
        return {"cache_on_error": f"cannot measure with the prefix cache on: {e}"}
    growth = after["VmHWM"] - before["VmRSS"]
    return {
        "cache_on_growth": growth,
        "cache_on_growth_over_kv": growth / kv,
        "cache_on_stored": stored,  # blocks the prefix cache keeps (its budget)
        # the transient part: growth beyond what the cache keeps
        "cache_on_transient_over_kv": (growth - stored) / kv,
    }


def latency_part(
    systems: Systems, lengths: tuple[int, ...], repeats: int, mlx_cap_s: float, say: Say
) -> list[dict[str, Any]]:
    """TTFT and TPOT per prompt length, the three systems interleaved."""
    latency: list[dict[str, Any]] = []
    mlx_rate: float | None = None  # seconds per prompt token, from the longest so far
    for n in sorted(lengths):
        text, ids = systems.prompt_for(n)
        row: dict[str, Any] = {"target": n, "prompt_tokens": len(ids)}
        runs: dict[str, list[dict[str, Any]]] = {"disagg": [], "transformers": [], "mlx_lm": []}
        for i in range(repeats):
            say(f"latency {len(ids)} tokens {i + 1}/{repeats}: disagg, transformers")
            runs["disagg"].append(systems.disagg_once(text))
            runs["transformers"].append(systems.hf_once(ids))
        mlx_rate = mlx_latency(systems, ids, mlx_rate, mlx_cap_s, row, runs["mlx_lm"], say)
        for system, rs in runs.items():
            row[system] = {
                "ttft_s": median_or_none([r["ttft_s"] for r in rs if r["ttft_s"] is not None]),
                "tpot_s": median_or_none([r["tpot_s"] for r in rs if r["tpot_s"] is not None]),
                "runs": rs,
            }
        firsts = {r["first_token"] for rs in runs.values() for r in rs}
        row["same_first_token"] = len(firsts) == 1
        latency.append(row)
    return latency


def mlx_latency(
    systems: Systems,
    ids: list[int],
    rate: float | None,
    cap_s: float,
    row: dict[str, Any],
    runs: list[dict[str, Any]],
    say: Say,
) -> float | None:
    """mlx-lm once on `ids` (into `runs`), in a child process killed after about
    `cap_s` when its projected TTFT passes that (marked in `row`). Returns the
    seconds per prompt token to project the next length with."""
    projected = rate * len(ids) if rate else None
    if projected is None or projected <= cap_s:
        say(f"latency {len(ids)} tokens: mlx-lm (once; its CPU prefill is slow)")
        runs.append(systems.mlx_once(ids))
        return float(runs[-1]["ttft_s"]) / len(ids)
    say(
        f"latency {len(ids)} tokens: mlx-lm in a child process, killed after "
        f"{cap_s:.0f} s (projected TTFT {projected:.0f} s)"
    )
    capped = mlx_capped(systems.model_dir, ids, systems.tokens, cap_s)
    if isinstance(capped, str):
        row["mlx_lm_capped"] = capped
    else:
        row["mlx_lm_child_process"] = True
        runs.append(capped)
    return rate


Stamped = tuple[Any, list[float]]  # (wireclient.Result, token arrival times)


def concurrency_part(
    pair: Pair, concurrency: tuple[int, ...], tokens: int, say: Say
) -> list[dict[str, Any]]:
    """Aggregate decode tokens/s of `n` requests at once to the one decode agent, per n."""
    req = {"prompt": DECODE_PROMPT, "max_tokens": tokens, "ignore_eos": True}
    conc: list[dict[str, Any]] = []
    for n in concurrency:
        say(f"concurrency: {n} requests at once, {tokens} tokens each")
        t0 = time.perf_counter()
        results = _at_once(pair, req, n)
        conc.append(concurrency_row(n, results, time.perf_counter() - t0))
    single = conc[0]["aggregate_tok_s"] if conc and conc[0]["requests"] == 1 else None
    for c in conc:
        c["vs_single"] = c["aggregate_tok_s"] / single if single else None
    return conc


def _at_once(pair: Pair, req: dict[str, Any], n: int) -> list[Stamped | BaseException]:
    """`n` copies of `req` in threads; each outcome, errors kept."""
    results: list[Stamped | BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            r: Stamped | BaseException = disaggregated(*pair, req)
        except BaseException as e:  # reported, never lost in a thread
            r = e
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def concurrency_row(n: int, results: list[Stamped | BaseException], wall: float) -> dict[str, Any]:
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    done = [r for r, _ in ok]
    stamps = [s for _, s in ok if s]
    total = sum(len(r.token_ids) for r in done)
    window = max(s[-1] for s in stamps) - min(s[0] for s in stamps) if stamps else 0.0
    after_first = sum(len(s) - 1 for s in stamps)
    return {
        "requests": n,
        "errors": errors,
        "completion_tokens": total,
        "wall_s": wall,
        "aggregate_tok_s": after_first / window if window > 0 else 0.0,
        "end_to_end_tok_s": total / wall,
        "decode_window_s": window,
        "per_request_decode_tok_s": median_or_none([float(r.metrics.decode_speed) for r in done]),
        "ttft_p50_s": median_or_none([float(r.metrics.ttft) for r in done]),
        "ttft_max_s": max((float(r.metrics.ttft) for r in done), default=None),
    }


MLX_CHILD = """
import json, sys, time
import disagg_agents.runtime.fastblas  # the same BLAS as the decode agent
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model = load(sys.argv[1])[0]
ids = json.loads(sys.stdin.readline())
stamps, first = [], None
t0 = time.perf_counter()
for token, _ in generate_step(mx.array(ids), model, max_tokens=int(sys.argv[2])):
    stamps.append(time.perf_counter() - t0)
    first = int(token) if first is None else first
print(json.dumps({"stamps": stamps, "first": first}), flush=True)
"""


MLX_LOAD_SLACK_S = 60.0  # loading takes seconds: generous, so only generation is capped


def mlx_capped(
    model_dir: Path,
    ids: list[int],
    tokens: int,
    cap_s: float,
    load_slack_s: float = MLX_LOAD_SLACK_S,
) -> dict[str, Any] | str:
    """mlx-lm's generate_step on `ids` in a child process that is killed after
    `cap_s` + `load_slack_s`; a timing dict, or why not."""
    import json
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", MLX_CHILD, str(model_dir), str(tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdin is not None
    t0 = time.perf_counter()
    try:
        out, _ = proc.communicate(json.dumps(ids) + "\n", timeout=cap_s + load_slack_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return (
            f"capped: killed after {time.perf_counter() - t0:.0f} s "
            f"(cap {cap_s:.0f} s + {load_slack_s:.0f} s for loading) without its {tokens} tokens"
        )
    if proc.returncode != 0 or not out.strip():
        return f"mlx-lm child failed with exit code {proc.returncode}"
    data = json.loads(out.strip().splitlines()[-1])
    stamps = data["stamps"]
    res = _timing(stamps, 0.0)
    res["first_token"] = data["first"]
    return res


SYSTEMS = (
    ("disagg", "disagg (torch prefill -> mlx decode)"),
    ("transformers", "transformers generate"),
    ("mlx_lm", "mlx-lm generate_step"),
)


def ttft_chart(report: dict[str, Any], path: Path) -> Path:
    """PNG of TTFT against prompt length, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for key, label in SYSTEMS:
        pts = [
            (row["prompt_tokens"], row[key]["ttft_s"])
            for row in report["latency"]
            if row[key]["ttft_s"] is not None
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=label)
    capped = [row["prompt_tokens"] for row in report["latency"] if row.get("mlx_lm_capped")]
    if capped:
        ax.text(0.02, 0.95, f"mlx-lm capped at {capped} tokens", transform=ax.transAxes)
    ax.set_xscale("log", base=2)
    ticks = [row["prompt_tokens"] for row in report["latency"]]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    m = report["machine"]
    ax.set_title(
        f"TTFT vs prompt length · {Path(report['model']).name}\n"
        f"{m['machine']} · {m['cpu_count']} CPUs · {report['date']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def serving_tables(report: dict[str, Any]) -> list[Table]:
    return [_latency_table(report), _memory_table(report["memory"]), _concurrency_table(report)]


def _latency_table(report: dict[str, Any]) -> Table:
    lat = table(
        f"TTFT and TPOT ({report['settings']['tokens']} new tokens, greedy)",
        (
            "prompt tokens",
            *(f"{label}\nTTFT s / TPOT ms" for _, label in SYSTEMS),
            "same 1st token",
        ),
        left=("same 1st token",),
        caption=(
            f"{report['date']} · load avg (1 min) {report['load_avg_1m']['start']} -> "
            f"{report['load_avg_1m']['end']} · disagg and transformers: median of "
            f"{report['settings']['repeats']}; mlx-lm: one run"
        ),
    )
    for row in report["latency"]:
        cells = []
        for key, _ in SYSTEMS:
            if key == "mlx_lm" and row.get("mlx_lm_capped"):
                cells.append(row["mlx_lm_capped"])
            else:
                cells.append(
                    f"{cell(row[key]['ttft_s'])} / {cell(row[key]['tpot_s'], 1e3, '{:.1f}')}"
                )
        lat.add_row(str(row["prompt_tokens"]), *cells, str(row["same_first_token"]))
    return lat


def _memory_table(mem: dict[str, Any]) -> Table:
    mt = table(
        "Decode agent memory during the longest handoff", ("measure", "value"), left=("measure",)
    )
    if "error" in mem:
        mt.add_row("error", mem["error"])
        return mt
    for key in ("baseline_rss", "peak_rss", "growth", "kv_bytes", "model_bytes"):
        mt.add_row(key, f"{mem[key] / 1e6:.1f} MB")
    mt.add_row(
        f"growth / KV ({mem['prompt_tokens']} tokens)",
        f"{mem['growth_over_kv']:.2f} (<= {mem['bar']} {verdict(mem['ok'])})",
    )
    mt.add_row(
        "peak <= model + 1.5 x KV, literally (no runtime allowance)",
        verdict(mem["ok_literal"]),
    )
    if "cache_on_growth" in mem:
        mt.add_row(
            "prefix cache on (a miss): growth / KV",
            f"{mem['cache_on_growth_over_kv']:.2f}, of which the cache keeps "
            f"{mem['cache_on_stored'] / 1e6:.1f} MB (rest {mem['cache_on_transient_over_kv']:.2f})",
        )
    elif "cache_on_error" in mem:
        mt.add_row("prefix cache on", mem["cache_on_error"])
    return mt


def _concurrency_table(report: dict[str, Any]) -> Table:
    c = report["concurrency"]
    ct = table(
        "Concurrent requests to one decode agent",
        (
            "requests",
            "aggregate decode tok/s",
            "x single",
            "end-to-end tok/s",
            "per-request tok/s",
            "TTFT p50/max s",
        ),
        caption=f"{c['note']}; decode agent BLAS: {report['machine'].get('decode_blas')}",
    )
    for r in c["runs"]:
        ct.add_row(
            str(r["requests"]),
            f"{r['aggregate_tok_s']:.2f}",
            cell(r["vs_single"], form="{:.2f}"),
            f"{r.get('end_to_end_tok_s', 0.0):.2f}",
            cell(r["per_request_decode_tok_s"], form="{:.2f}"),
            f"{cell(r['ttft_p50_s'], form='{:.1f}')} / {cell(r['ttft_max_s'], form='{:.1f}')}"
            + (f" [red]{len(r['errors'])} errors[/]" if r["errors"] else ""),
        )
    ct.add_row(
        "bar",
        f">= x{c['bar']:g} at {c['runs'][-1]['requests'] if c['runs'] else '-'}",
        verdict(c["ok"]),
        "",
        "",
        "",
    )
    return ct

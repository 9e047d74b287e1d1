"""How long a decoding stream stalls while its agent prefills another prompt locally.

A local prefill runs on the decode agent's one mlx thread. `prefill_stall` starts
one stream, then sends the same agent a prompt of `prompt_tokens` to prefill
itself (no prefill agent), and measures the stream's longest gap between two
tokens that overlaps that prefill, against the prefill's own time (from the
second request's timeline): about 1.0 when the prompt goes through as one task,
small when its chunks interleave with decode steps (target <= 0.15).

`python -m disagg.bench.stall MODEL_DIR` starts a local pair and prints that and
the 16-way aggregate decode rate against one stream (`batch_gain`, prompts
prefilled on the decode agent), with the load average.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from disagg.bench.common import (
    DECODE_PROMPT,
    Say,
    Stamp,
    cell,
    local_pair,
    long_text,
    need,
    num,
    quiet,
    table,
    verdict,
)
from disagg.serving import wireclient
from disagg.serving.localagents import AgentProc
from disagg_agents.wire.answer import TokenEvent

STALL_BAR = 0.15  # longest gap during the prefill / the prefill's time


class _Stop(Exception):
    """Raised from the stream's callback to end it once measured."""


def prefill_stall(
    decode: AgentProc,
    count_tokens: Callable[[str], int],
    prompt_tokens: int = 1500,
    say: Say = quiet,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """One stream's longest inter-token gap while `decode` prefills a
    `prompt_tokens` prompt locally, and that prefill's time (plain data)."""
    arrivals: list[float] = []  # wall clock: the agent's timeline is in Unix time
    going, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def on_token(ev: TokenEvent) -> None:
        if ev.id is not None:
            arrivals.append(time.time())
        if len(arrivals) >= 4:
            going.set()
        if stop.is_set():
            raise _Stop

    def stream() -> None:
        req = {"prompt": DECODE_PROMPT, "max_tokens": 1 << 20, "ignore_eos": True}
        try:
            wireclient.generate(
                decode.host, decode.port, req, token=decode.token, on_token=on_token,
                timeout_s=timeout_s,
            )  # fmt: skip
        except _Stop:
            pass
        except BaseException as e:  # reported, never lost in a thread
            failed.append(e)
        going.set()

    say(f"stall: one stream, then a {prompt_tokens}-token prompt prefilled on the same agent")
    text = long_text(count_tokens, prompt_tokens)
    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        going.wait(timeout_s)
        if failed:
            raise failed[0]
        req = {"prompt": text, "raw": True, "max_tokens": 2, "ignore_eos": True}
        res = wireclient.generate(
            decode.host, decode.port, req, token=decode.token, timeout_s=timeout_s
        )
    finally:
        stop.set()
        streamer.join(timeout_s)
    return _gaps(arrivals, res)


def _gaps(arrivals: list[float], res: wireclient.Result) -> dict[str, Any]:
    """The stream's token arrivals against the prefill's window on the agent's timeline."""
    t = need(res.metrics.timeline, "timeline")
    at = need(t.at, "timeline start")
    start, stop = need(t.prefill_start, "prefill start"), need(t.prefill_end, "prefill end")
    begin, end = at + start, at + stop
    gaps = [(a, b) for a, b in zip(arrivals, arrivals[1:], strict=False) if b > begin and a < end]
    before = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b <= begin]
    longest = max((b - a for a, b in gaps), default=end - begin)
    prefill_s = end - begin
    return {
        "prompt_tokens": res.metrics.prompt_tokens,
        "prefill_s": prefill_s,
        "longest_gap_s": longest,
        "gap_vs_prefill": longest / prefill_s if prefill_s > 0 else None,
        "tokens_during_prefill": sum(begin < a < end for a in arrivals),
        "step_s_before": sorted(before)[len(before) // 2] if before else None,
        "bar": STALL_BAR,
    }


def batch_gain(decode: AgentProc, n: int, tokens: int = 64) -> dict[str, Any]:
    """Aggregate decode tokens/s of `n` streams at once on `decode`, each prefilled
    there (a short prompt: no prefill agent in the way), as serving.py counts it."""
    from disagg.bench.serving import concurrency_row

    results: list[Any] = []
    lock = threading.Lock()
    req = {"prompt": DECODE_PROMPT, "max_tokens": tokens, "ignore_eos": True}

    def one() -> None:
        stamps: list[float] = []

        def on_token(ev: TokenEvent) -> None:
            if ev.id is not None:
                stamps.append(time.perf_counter())

        try:
            res: Any = wireclient.generate(
                decode.host, decode.port, req, token=decode.token, on_token=on_token,
                timeout_s=1800,
            )  # fmt: skip
            out: Any = (res, stamps)
        except BaseException as e:  # reported, never lost in a thread
            out = e
        with lock:
            results.append(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return concurrency_row(n, results, time.perf_counter() - t0)


def run_stall_bench(
    model_dir: Path,
    prompt_tokens: int = 1500,
    say: Say = quiet,
    streams: int = 16,
    stream_tokens: int = 64,
) -> dict[str, Any]:
    """The stall figure, then decode tok/s of 1 stream and of `streams` at once, each
    `stream_tokens` long (the tests ask for their smallest real size)."""
    from transformers import AutoTokenizer

    stamp = Stamp()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with local_pair(model_dir, say) as pair:
        warm = {"prompt": DECODE_PROMPT, "max_tokens": 4}
        wireclient.generate(pair[1].host, pair[1].port, warm, token=pair[1].token)
        stall = prefill_stall(pair[1], lambda s: len(tok.encode(s)), prompt_tokens, say)
        rows = []
        for n in (1, streams):
            say(f"batch: {n} streams at once on the decode agent")
            rows.append(batch_gain(pair[1], n, stream_tokens))
    single = rows[0]["aggregate_tok_s"]
    return {
        "stall": stall,
        "batch": rows,
        f"batch_{streams}_vs_1": rows[-1]["aggregate_tok_s"] / single if single else None,
        "load_avg_1m": stamp.load_avg_1m(),
        "elapsed_s": stamp.elapsed_s(),
    }


def stall_table(r: dict[str, Any]) -> Table:
    """Render `run_stall_bench`'s result."""
    st = r["stall"]
    t = table(
        f"a stream while its agent prefills {st['prompt_tokens']} tokens itself",
        ("figure", "value", "bar"),
        caption="load average (1 min): {start} at the start, {end} at the end".format(
            **r["load_avg_1m"]
        ),
        left=("figure",),
    )
    gap = st["gap_vs_prefill"]
    ok = gap is not None and gap <= st["bar"]
    t.add_row("prefill", num(st["prefill_s"], "s"), "")
    t.add_row("longest gap in the stream", num(st["longest_gap_s"], "s"), "")
    t.add_row("gap / prefill", cell(gap), f"<= {st['bar']} {verdict(ok)}")
    t.add_row("tokens during the prefill", str(st["tokens_during_prefill"]), "")
    for row in r["batch"]:
        t.add_row(
            f"{row['requests']} streams: tok/s in all",
            cell(row["aggregate_tok_s"], form="{:.1f}"),
            "",
        )
    n = r["batch"][-1]["requests"]
    t.add_row(f"{n} streams / 1", cell(r[f"batch_{n}_vs_1"], form="{:.2f}"), "")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    args = ap.parse_args()
    print(json.dumps(run_stall_bench(args.model, args.prompt_tokens, print), indent=1))


if __name__ == "__main__":
    main()

"""`disagg plan`: the cost model of the user's cluster (disagg.bench.costmodel)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from disagg.cli.common import Json, app, friendly, out, say
from disagg.errors import UsageError


@app.command()
@friendly
def plan(
    as_json: Json = False,
    count_layers: Annotated[
        int,
        typer.Option(
            "--count-layers",
            help="Layers of each model built at its real shapes to count aten ops and host "
            "syncs on this machine (written once into the cache: ~1 and ~3.4 GB at 2 layers; "
            "~8 GB of memory while counting GPT-OSS). 0: no counting pass, launch costs "
            "left out.",
        ),
    ] = 2,
    link: Annotated[
        str, typer.Option("--link", help="Spark -> Mac link: 10gbe or cx7-200g.")
    ] = "10gbe",
) -> None:
    """Predict prefill, TTFT and decode of the user's models on Spark -> Mac vs the Mac
    alone: a roofline model from published device figures, with ops counted here."""
    from disagg.bench.costmodel import MODELS, Counts, count
    from disagg.bench.costmodel import plan as build
    from disagg_agents.models.cost import LINKS

    if link not in LINKS:
        raise UsageError(f"unknown link {link!r}: use one of {', '.join(LINKS)}")
    counts: dict[str, Counts | None] = {}
    for name in MODELS:
        if count_layers <= 0:
            counts[name] = None
            continue
        say(f"counting {name} at its real layer shapes, {count_layers} layers ...")
        counts[name] = count(name, count_layers)
    data = build(counts, link)
    if as_json:
        print(json.dumps(data, indent=2))
        return
    for table in plan_tables(data):
        out.print(table)


def _g(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".strip()


def _s(x: float) -> str:
    return f"{x * 1e3:,.0f} ms" if x < 10 else f"{x:,.1f} s"


def plan_tables(data: dict[str, Any]) -> list[Table]:
    """A per-forward table and a per-scenario table (a model: labelled so)."""
    fwd = Table(title="One prefill forward of 2,048 tokens on the Spark (model)")
    for col in (
        "model",
        "weights",
        "aten ops",
        "host syncs",
        "FLOPs",
        "weights read",
        "dequantized",
        "K/V",
    ):
        fwd.add_column(col, justify="left" if col in ("model", "weights") else "right")
    times = Table(
        title=f"Predicted on the grader's load: Spark -> Mac over {data['link']['name']} "
        "vs the Mac alone (roofline model)"
    )
    cols = (
        "model",
        "load",
        "Spark prefill",
        "TTFT split",
        "TTFT Mac",
        "split speedup",
        "decode/token",
        "loop prefill",
        "fused-kernel prefill",
    )
    for col in cols:
        times.add_column(col, justify="left" if col in ("model", "load") else "right")
    for m in data["models"].values():
        f = m["forward_2048"]
        fwd.add_row(
            m["label"],
            m["spark_weights"],
            _g(f["aten_ops"]),
            _g(f["host_syncs"]),
            _g(f["flops"]),
            _g(f["weight_bytes_read"], "B"),
            _g(f["bytes_dequantized"], "B"),
            _g(f["kv_bytes"], "B"),
        )
        for label, sc in m["scenarios"].items():
            loop = sc.get("spark_prefill_loop_s")
            times.add_row(
                m["label"],
                f"{label} ({sc['tokens']:,} new, {sc['context']:,} cached)",
                _s(sc["spark_prefill_s"]),
                _s(sc["ttft_disaggregated_s"]),
                _s(sc["ttft_mac_alone_s"]),
                f"{sc['speedup_ttft']:.2f}x",
                _s(sc["decode_s_per_token"]),
                _s(loop) if loop is not None else "-",
                _s(sc["spark_prefill_fused_s"]),
            )
        cross, cached = m["crossover_tokens"], m["crossover_tokens_after_3000_cached"]
        times.add_row(
            m["label"],
            "the split wins from",
            f"{cross:,} tokens" if cross else "never",
            f"{cached:,} new after 3,000 cached" if cached else "never after 3,000 cached",
            end_section=True,
        )
    src = Table(title="Figures the model uses (sources)")
    src.add_column("device")
    src.add_column("GB/s", justify="right")
    src.add_column("TFLOP/s", justify="right")
    src.add_column("source")
    for d in data["devices"].values():
        src.add_row(
            d["name"], f"{d['bandwidth'] / 1e9:,.0f}", f"{d['flops'] / 1e12:,.0f}", d["source"]
        )
    src.add_row(
        data["link"]["name"], f"{data['link']['bytes_per_s'] / 1e9:.2f}", "", data["link"]["source"]
    )
    return [fwd, times, src]

"""`disagg plan`: what a Spark prefilling for a Mac should give on the user's models
(disagg.bench.costmodel: a model calibrated to published measurements)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from disagg.cli.common import Json, app, friendly, out, say
from disagg.errors import UsageError

MACS = ("m3-ultra", "m4-max")


@app.command()
@friendly
def plan(
    as_json: Json = False,
    mac: Annotated[
        str, typer.Option("--mac", help="The Mac that decodes: m3-ultra or m4-max.")
    ] = "m3-ultra",
    link: Annotated[
        str, typer.Option("--link", help="The Spark-to-Mac link: 10gbe, tb5 or cx7-200g.")
    ] = "10gbe",
    moe_path: Annotated[
        str,
        typer.Option(
            "--moe-path",
            help="How the Spark runs the experts: triton (the fused kernel), grouped "
            "or blocked (the path before the fused kernel).",
        ),
    ] = "triton",
    count_layers: Annotated[
        int,
        typer.Option(
            "--count-layers",
            help="Also build each model at its real layer shapes with this many layers "
            "and count kernel launches on this machine (minutes; ~4 GB of disk and "
            "~8 GB of memory). 0, the default: skip it.",
        ),
    ] = 0,
) -> None:
    """Predict TTFT and decode speed of a DGX Spark prefilling for a Mac.

    Qwen3-Coder-30B-A3B and GPT-OSS-120B at 2k to 64k prompt tokens, against the Mac
    alone. The model is fitted to published figures (llama.cpp on the Spark, mlx-lm on
    the Macs) and checked against EXO's published Spark + M3 Ultra run.

    Columns: prompt (new tokens); Spark (its prefill on --moe-path); before (the same
    prompt on the path before the fused kernel: blocked experts, and the n x n
    attention matrix where that was the default; "no memory" where it did not fit);
    K/V (bytes sent to the Mac); TTFT split (first token with the Spark prefilling:
    prefill, transfer, first step); TTFT Mac (the Mac alone); split (TTFT Mac over
    TTFT split: above 1x the split answers first)."""
    from disagg.bench.costmodel import USER_MODELS, Counts, count
    from disagg.bench.costmodel import plan as build
    from disagg_agents.models.cost import LINKS, MOE_PATHS

    for flag, value, allowed in (
        ("--mac", mac, MACS),
        ("--link", link, tuple(LINKS)),
        ("--moe-path", moe_path, MOE_PATHS),
    ):
        if value not in allowed:
            raise UsageError(f"unknown {flag} {value!r}: use one of {', '.join(allowed)}")
    counts: dict[str, Counts] = {}
    for name in USER_MODELS if count_layers > 0 else ():
        say(f"counting {name} at its real layer shapes, {count_layers} layers ...")
        counts[name] = count(name, count_layers)
    data = build(mac, link, moe_path, counts)
    if as_json:
        print(json.dumps(data, indent=2))
        return
    for shown in plan_tables(data):
        out.print(shown)


def _s(x: float | None) -> str:
    if x is None:
        return "no memory"
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def plan_tables(data: dict[str, Any]) -> list[RenderableType]:
    """One table per model, the check against EXO, the efficiencies and their sources."""
    from disagg.bench.costmodel import PromptRow

    shown: list[RenderableType] = [
        Text(
            f"DGX Spark -> {data['mac']['name']} over {data['link']['name']}, against the "
            "Mac alone: a model fitted to published figures, not a measurement. Spark: "
            f"prefill with the {data['moe_path']} MoE path (the default on CUDA: triton) "
            "and attention without the n x n matrix. Decode runs on the Mac either way."
        )
    ]
    for m in data["models"].values():
        t = Table(title=m["label"])
        for col in ("prompt", "Spark", "before", "K/V", "TTFT split", "TTFT Mac", "split"):
            t.add_column(col, justify="right")
        for sc in map(PromptRow.from_json, m["prompts"]):
            t.add_row(
                f"{sc.tokens:,}",
                _s(sc.spark_prefill_s),
                _s(sc.spark_today_s),
                f"{sc.kv_bytes / 1e9:.2f} GB",
                _s(sc.ttft_split_s),
                _s(sc.ttft_mac_alone_s),
                f"{sc.speedup:.2f}x",
            )
        cross = m["crossover_tokens"]
        step = m["prompts"][0]["decode_s_per_token"]
        t.caption = (
            f"The split wins from {cross:,} prompt tokens" if cross else "The split never wins"
        ) + f"; decode {1 / step:.0f} tok/s at 2k."
        shown.append(t)
        paths = "; ".join(f"{k}: {v}" for k, v in m["layer_paths"].items())
        shown.append(Text(f"On the Spark: {paths}."))
    exo = data["exo_check"]
    shown.append(
        Text(
            f"Checked against EXO's published split (Llama-3.1-8B FP16, 8k prompt, one "
            f"Spark + one M3 Ultra over 10 GbE): published {exo['published']:.1f}x, this "
            f"model {exo['speedup']:.2f}x; {exo['speedup_llamacpp_spark']:.2f}x with the "
            "Spark's dense rate taken from llama.cpp instead of EXO's own prefill time."
        )
    )
    src = Table(title="Fitted efficiencies (share of nominal FLOP/s and bandwidth)")
    for col in ("device", "MoE prefill", "dense prefill", "MoE decode", "dense decode"):
        src.add_column(col, justify="left" if col == "device" else "right")
    for name, e in data["efficiency"].items():
        effs = (e["moe"], e["dense"], e["decode_moe"], e["decode_dense"])
        src.add_row(name, *(f"{x:.0%}" for x in effs))
    shown.append(src)
    lines = [f"{name}: {e['source']}" for name, e in data["efficiency"].items()]
    lines.append(f"{data['link']['name']}: {data['link']['source']}")
    shown.append(Text("Sources. " + "\n".join(lines)))
    return shown

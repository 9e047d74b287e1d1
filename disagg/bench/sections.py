"""Every benchmark kind as one call: its report (plain data) and its tables, for
`disagg bench <kind>` to print and `disagg bench all` to gather in one report.

Each kind imports its bench module only when run: listing the kinds loads none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagg.serving.defaultmodel import Say

if TYPE_CHECKING:
    from rich.table import Table


@dataclass
class Section:
    """One kind's result: `key` names it inside `all`'s report."""

    key: str
    report: dict[str, Any]
    tables: list[Table] = field(default_factory=list)


def core(
    model_dir: Path, say: Say, repeats: int = 3, decode_tokens: int = 64, prompt_tokens: int = 2000
) -> Section:
    """Decode tokens/s against mlx-lm's own generation, TTFT against transformers'."""
    from disagg.bench.core import bench_table, run_core_bench

    report = run_core_bench(
        model_dir,
        repeats=repeats,
        decode_tokens=decode_tokens,
        long_prompt_tokens=prompt_tokens,
        say=say,
    )
    return Section("core", report, [bench_table(report)])


def wire(model_dir: Path, say: Say) -> Section:
    from disagg.bench.wire import run_wire_bench, wire_tables

    report = run_wire_bench(model_dir, say=say)
    return Section("wire", report, wire_tables(report))


def serving(model_dir: Path, say: Say, png: Path | None = None) -> Section:
    from disagg.bench.serving import run_serving_bench, serving_tables, ttft_chart

    report = run_serving_bench(model_dir, say=say)
    if png:
        report["png"] = str(ttft_chart(report, png))
        say(f"wrote {png}")
    return Section("serving", report, serving_tables(report))


def hiding(model_dir: Path, say: Say) -> Section:
    from disagg.bench.hiding import hiding_table, run_hiding_bench

    report = run_hiding_bench(model_dir, say=say)
    return Section("hiding", report, [hiding_table(report)])


def kvquant(model_dir: Path, say: Say) -> Section:
    from disagg.bench.kvquant import kvquant_table, run_kvquant_bench

    report = run_kvquant_bench(model_dir, say=say)
    return Section("kv_quant", report, [kvquant_table(report)])


def quant_weights(model_dir: Path, say: Say) -> Section:
    """On `model_dir` if it is quantized, else on the default model quantized to 4
    bits (by mlx_lm.convert, once)."""
    from disagg.bench.quant_weights import quant_weights_table, run_quant_weights_bench
    from disagg_agents.models import load_hf_config
    from disagg_agents.quant import is_quantized

    qdir = model_dir if is_quantized(load_hf_config(model_dir)) else None
    report = run_quant_weights_bench(qdir, say=say)
    return Section("quant_weights", report, [quant_weights_table(report)])


def prefix(model_dir: Path, say: Say) -> Section:
    from disagg.bench.prefix import prefix_table, run_prefix_bench

    report = run_prefix_bench(model_dir, say=say)
    return Section("prefix", report, [prefix_table(report)])


def formats(model_dir: Path, say: Say) -> Section:
    from disagg.bench.formats import formats_table, run_formats_bench

    report = run_formats_bench(model_dir, say=say)
    return Section("formats", report, [formats_table(report)])


def speculate(model_dir: Path, say: Say, decode_tokens: int = 96) -> Section:
    from disagg.bench.speculate import run_speculate_bench, speculate_table

    report = run_speculate_bench(model_dir, say=say, decode_tokens=decode_tokens)
    return Section("speculate", report, [speculate_table(report)])


def load_settings(spec: str) -> Any:
    """`--sizes` as LoadSettings; ValueError naming what is wrong."""
    from disagg.bench.load import parse_sizes

    return parse_sizes(spec)


def load(model_dir: Path, say: Say, sizes: str = "small", url: str | None = None) -> Section:
    from disagg.bench.load import load_table, run_load_bench

    report = run_load_bench(model_dir, load_settings(sizes), say=say, url=url)
    return Section("load", report, [load_table(report)])


def stall(model_dir: Path, say: Say, prompt_tokens: int = 1500) -> Section:
    from disagg.bench.stall import run_stall_bench, stall_table

    report = run_stall_bench(model_dir, prompt_tokens, say)
    return Section("stall", report, [stall_table(report)])


def integrity(say: Say, layer_mb: float = 8.0, layers: int = 48) -> Section:
    from disagg.bench.integrity import integrity_table, measure

    say(f"{layers} frames of {layer_mb:g} MiB, bare and sealed, over loopback")
    report = measure(layer_mb, layers)
    return Section("integrity", report, [integrity_table(report)])


# What `disagg bench all` runs after `core`, in this order (integrity and stall,
# which take their own settings, only when asked by name).
ALL: tuple[Callable[[Path, Say], Section], ...] = (
    wire,
    serving,
    hiding,
    kvquant,
    quant_weights,
    prefix,
    formats,
)


def run_all(
    model_dir: Path,
    say: Say,
    *,
    core_settings: dict[str, int],
    sizes: str = "small",
    png: Path | None = None,
) -> Section:
    """`core`'s report with every other kind's under its key, and all their tables."""
    load_settings(sizes)  # a bad --sizes fails before anything runs
    whole = core(model_dir, say, **core_settings)
    for run in ALL:
        part = serving(model_dir, say, png) if run is serving else run(model_dir, say)
        whole.report[part.key] = part.report
        whole.tables += part.tables
    part = load(model_dir, say, sizes)
    whole.report[part.key] = part.report
    whole.tables += part.tables
    return whole

"""Rich renderings of results; nothing here computes anything."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from disagg.cli.plain import plain
from disagg.serving.metrics import SEED_NAMES, Metrics
from disagg.units import UNITS, fmt

if TYPE_CHECKING:  # numpy: not loaded for the light commands
    from disagg.serving.verify import VerifyReport


def metrics_table(metrics: Metrics, title: str = "metrics") -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in SEED_NAMES:
        table.add_row(name, fmt(getattr(metrics, name), UNITS.get(name, "")))
    if metrics.fallback_reason:
        table.add_row("fallback_reason", plain(metrics.fallback_reason, None))
    if metrics.weights:
        table.add_row("weights", plain(metrics.weights))  # "mixed": other weights prefilled
    return table


def tool_calls_table(calls: list[dict[str, Any]]) -> Table:
    """The model's tool calls: each function with its arguments as JSON (plain text,
    never markup: they are the model's words)."""
    import json

    from rich.text import Text

    table = Table(title="tool calls", header_style="bold")
    table.add_column("function")
    table.add_column("arguments")
    for call in calls:
        table.add_row(Text(str(call.get("name"))), Text(json.dumps(call.get("arguments"))))
    return table


def verify_table(report: VerifyReport) -> Table:
    table = Table(title="verify: disaggregated vs decode-only", header_style="bold")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("model", plain(report.model))
    table.add_row("tokens compared", str(report.compared))
    table.add_row("token agreement", f"{report.agreement:.1%}")
    div = report.first_divergence
    table.add_row("first divergence", "none" if div is None else f"token {div}")
    table.add_row("max |logit diff| (log-softmax)", f"{report.max_logit_diff:.3g}")
    table.add_row("logit diff at divergence", fmt(report.logit_diff_at_divergence))
    table.add_row("kv_bytes", fmt(report.kv_bytes, "B"))
    if report.weights:
        table.add_row("weights (prefill vs decode)", str(report.weights))
    verdict = "[green]pass[/]" if report.ok else "[red]FAIL[/]"
    table.add_row("verdict", verdict)
    return table


def batch_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> Table:
    table = Table(title="requests", header_style="bold")
    for col in ("id", "model", "method", "ttft", "tokens", "time", "text / error"):
        table.add_column(col)
    for r in rows:
        m = Metrics.from_json(r.get("metrics") or {})
        error = r.get("error")
        text = plain(error, style="red") if error else plain((r.get("text") or "").strip(), 60)
        table.add_row(
            plain(r["id"]),
            plain(r.get("model")),
            plain(m.method or "-"),
            fmt(m.ttft, "s"),
            fmt(m.completion_tokens),
            fmt(r.get("time"), "s"),
            text,
        )
    ratio = summary["wall_time"] / summary["sum_time"] if summary["sum_time"] else 0.0
    table.caption = (
        f"{summary['requests']} requests, {summary['failed']} failed; wall "
        f"{fmt(summary['wall_time'], 's')} vs sum of request times {fmt(summary['sum_time'], 's')}"
        f" ({ratio:.2f}x)" + (f"; results in {summary['out']}" if summary.get("out") else "")
    )
    return table

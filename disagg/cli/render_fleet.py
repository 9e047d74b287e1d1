"""Rich tables for fleet results; nothing here computes anything. Every string
a host or agent supplied goes through `disagg.cli.plain` (never markup), and
each status row is rendered on its own: one hostile /status costs its row only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from disagg.cli.plain import plain, plain_lines
from disagg.fleet.deploy import HostDeploy
from disagg.fleet.operations import AgentAction, HostProbe, LogLine
from disagg.fleet.ssh import HostResult
from disagg.fleet.tune import Tuned
from disagg.units import fmt
from disagg_agents.wire.status import AgentStatus, PrefixDiskStatus
from disagg_agents.wire.text import printable

STATE_STYLE = {
    "healthy": "green",
    "stopped": "yellow",
    "starting": "cyan",
    "not responding": "red",
    "bad answer": "red",
    "unreachable": "red",
    "not deployed": "yellow",
}


def _error(text: str) -> Text:
    return plain_lines(text, style="red")


def deploy_table(results: list[HostResult[HostDeploy]], dry_run: bool = False) -> Table:
    title = "deploy (dry run: nothing changed)" if dry_run else "deploy"
    table = Table(title=title, header_style="bold")
    for col in ("host", "platform", "service", "python", "agents", "config", "result"):
        table.add_column(col, overflow="fold")
    for r in results:
        d = r.value
        if d is None:
            table.add_row(plain(r.host), "", "", "", "", "", _error(r.error or "failed"))
            continue
        if d.uploaded or d.removed:
            verb = "would upload" if dry_run else "uploaded"
            files = f"{verb} {len(d.uploaded)}, {d.unchanged} unchanged"
            if d.removed:
                files += f", {len(d.removed)} removed"
        else:
            files = f"unchanged ({d.unchanged} files)"
        config = ", ".join(f"{role} changed" for role in d.configs_changed) or "unchanged"
        done = "; ".join([*(f"restarted {role}" for role in d.restarted), *d.notes])
        result = Text("ok", style="green")
        if done:
            result.append(" ").append_text(plain_lines(done))
        cells = (r.host, d.platform, d.service, d.python, files, config)
        table.add_row(*(plain(c) for c in cells), result)
    return table


def actions_table(results: list[HostResult[list[AgentAction]]], title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("host", "role", "result", "detail"):
        table.add_column(col, overflow="fold")
    for r in results:
        if r.value is None:
            table.add_row(plain(r.host), "", Text("failed", style="red"), _error(r.error or ""))
            continue
        if not r.value:
            table.add_row(plain(r.host), "", "-", "no agents placed here")
        for a in r.value:
            table.add_row(
                plain(a.host), plain(a.role), plain(a.action, style="green"), plain_lines(a.detail)
            )
    return table


def _mem(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def _plain(value: object) -> Text:
    """What an agent said, as text: never parsed as markup, control characters shown."""
    return plain(value, 120)


def _guarded(s: HostProbe, render: Callable[[HostProbe], list[Any]]) -> list[Any] | None:
    """A row, or None when this agent's /status has a field of another type or does
    not render (a number too large to format): its row says so."""
    if s.status.mistyped:
        return None
    try:
        return render(s)
    except (ValueError, OverflowError):  # a hostile or broken answer: this row only
        return None


def _bad_why(s: HostProbe) -> str:
    """Why this agent's /status does not render: the fields it sent mistyped."""
    if s.status.mistyped:
        return f"/status fields of unexpected types: {printable(', '.join(s.status.mistyped), 300)}"
    return "/status fields out of range"


def _bad_row(s: HostProbe, ncols: int) -> list[Any]:
    why = Text("bad answer", style="red").append(f"\n{_bad_why(s)}", style="dim")
    return [_plain(s.host), _plain(s.role), why, *["-"] * (ncols - 3)]


def status_table(rows: list[HostProbe], width: int | None = None) -> RenderableType:
    """One table with a column per fact when it fits `width` with every cell on one
    line; otherwise (an 80-column terminal) a short table of host, role, state,
    requests and p50 TTFT, with each agent's details on lines under it."""
    cols = ("host", "role", "state", "model", "loaded", "backend/device", "address",
            "uptime", "requests", "ttft p50/p95/p99", "prefix cache", "memory")  # fmt: skip
    cells = [_guarded(s, _wide_row) for s in rows]
    good = [r for r in cells if r is not None]
    widths = [max([len(c), *(len(str(r[i])) for r in good)]) for i, c in enumerate(cols)]
    if width is not None and sum(widths) + 3 * len(cols) + 1 > width:
        return _status_narrow(rows)
    table = Table(title="fleet status", header_style="bold")
    for col in cols:  # they fit: only the state's detail may wrap
        table.add_column(col, overflow="fold", no_wrap=col != "state")
    for s, row in zip(rows, cells, strict=True):
        if row is None:
            table.add_row(*_bad_row(s, len(cols)))
            continue
        table.add_row(*(_plain(c) for c in row[:2]), _state(s), *(_plain(c) for c in row[3:]))
    return table


def _wide_row(s: HostProbe) -> list[str]:
    st = s.status
    return [
        s.host,
        s.role,
        s.state,
        _model(st),
        fmt(st.loaded),
        _backend(st),
        s.address or "-",
        fmt(st.uptime_s, "s"),
        fmt(st.requests),
        _ttfts(st),
        _prefix_cache(st),
        _mem(s.rss_bytes),
    ]


def _prefix_cache(st: AgentStatus) -> str:
    """Hit rate over lookups, then bytes held of the budget (agents' /status)."""
    pc = st.prefix_cache
    if pc is None:
        return "-"
    hits = "-" if pc.hit_rate is None else f"{100 * pc.hit_rate:.0f}%"
    size = f"{_mem(pc.bytes)} / {_mem(pc.max_bytes)}"
    if st.prefix_disk is not None:  # a decode agent run with --prefix-disk
        size += f"; disk {disk_tier(st.prefix_disk)}"
    return f"hit {hits} of {fmt(pc.queries)}, {size}"


def disk_tier(disk: PrefixDiskStatus | None) -> str:
    """A decode agent's prefix disk tier: hits, then bytes held of the budget."""
    if disk is None:
        return "-"
    return f"{fmt(disk.hits)} hits, {_mem(disk.bytes)} / {_mem(disk.max_bytes)}"


def _ttfts(st: AgentStatus) -> str:
    if not st.doc:
        return "-"
    return " / ".join(fmt(t, "s") for t in (st.ttft_p50_s, st.ttft_p95_s, st.ttft_p99_s))


def _state(s: HostProbe) -> Text:
    state = Text(s.state, style=STATE_STYLE.get(s.state, ""))
    if s.detail and not s.ok:
        state.append(f"\n{printable(s.detail, 300)}", style="dim")
    if s.ssh_error:
        state.append(f"\nbut ssh failed: {printable(s.ssh_error, 300)}", style="red")
    return state


def _model(st: AgentStatus) -> str:
    return printable((st.model or "-").rstrip("/").rsplit("/", 1)[-1], 120)


def _backend(st: AgentStatus) -> str:
    if not st.backend:
        return "-"
    text = f"{st.backend}/{st.device}"
    # Which BLAS an mlx CPU runs its matmuls on ("openblas (numpy): PATH" -> "openblas (numpy)"):
    # mlx's bundled one is several times slower (disagg_agents/runtime/fastblas.py).
    if st.blas is not None and "cpu" in str(st.device):
        text += f", {st.blas.split(':')[0]}" + (" BLAS" if st.blas == "bundled" else "")
    # Fewer BLAS threads than it started with, and why (disagg_agents/runtime/blasshare.py).
    if st.blas_limited_by is not None and st.blas_threads is not None:
        threads = st.blas_threads
        text += f", {threads} BLAS thread{'s' if threads > 1 else ''} ({st.blas_limited_by})"
    return printable(text, 120)


def _status_narrow(rows: list[HostProbe]) -> Group:
    table = Table(title="fleet status", header_style="bold")
    for col in ("host", "role", "state", "requests", "ttft p50"):
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    details: list[Text] = []
    for s in rows:
        row = _guarded(s, _narrow_row)
        if row is None:  # why, under the table: a cell there is one short line
            table.add_row(_plain(s.host), _plain(s.role), Text("bad answer", style="red"), "-", "-")
            details.append(Text(printable(f"{s.host}/{s.role}", 120), style="bold"))
            details[-1].append(f"\n  {_bad_why(s)}", style="dim")
            continue
        table.add_row(*row[:5])
        details.append(row[5])
    return Group(table, *details)


def _narrow_row(s: HostProbe) -> list[Any]:
    """The short table's cells, then the agent's lines under it."""
    st = s.status
    answered = bool(st.doc)
    cells: list[Any] = [
        _plain(s.host),
        _plain(s.role),
        Text(s.state, style=STATE_STYLE.get(s.state, "")),
        _plain(fmt(st.requests)) if answered else "-",
        _plain(fmt(st.ttft_p50_s, "s")) if answered else "-",
    ]
    line = Text(printable(f"{s.host}/{s.role}", 120), style="bold")
    if answered:
        line.append(f"  {_model(st)}")
        address = printable(s.address or "-", 120)
        line.append(
            f"\n  {_backend(st)} at {address}, up {fmt(st.uptime_s, 's')}, "
            f"memory {_mem(s.rss_bytes)}\n  ttft p50/p95/p99 {_ttfts(st)}"
        )
        if st.prefix_cache is not None:
            line.append(f"\n  prefix cache {_prefix_cache(st)}")
    if s.detail and not s.ok:
        line.append(f"\n  {printable(s.detail, 300)}", style="dim")
    if s.ssh_error:
        line.append(f"\n  but ssh failed: {printable(s.ssh_error, 300)}", style="red")
    return [*cells, line]


def status_json(rows: list[HostProbe]) -> list[dict[str, Any]]:
    """Each row as found, its agent's /status as the agent sent it."""
    fields = [f.name for f in dataclasses.fields(HostProbe)]
    return [
        {**{f: getattr(s, f) for f in fields}, "status": s.status.doc, "ok": s.ok} for s in rows
    ]


def log_line(line: LogLine, width: int) -> Text:
    prefix = f"{line.host}/{line.role}" if line.role else line.host
    bad = line.error or line.stream == "stderr"  # stderr: what the agent could not log
    text = Text(
        f"{prefix:<{width}} {'!' if line.stream == 'stderr' else '|'} ",
        style="bold red" if bad else "dim",
    )
    text.append_text(plain(line.text, None, style="red" if bad else ""))
    return text


def tune_table(rows: list[Tuned], changed: bool) -> RenderableType:
    """Each agent's live settings, one per line, those just set in bold; or its error."""
    table = Table(
        title="live settings (changed)" if changed else "live settings", header_style="bold"
    )
    for col in ("host", "role", "address", "settings"):
        table.add_column(col, overflow="fold")
    for r in rows:
        if r.error:
            cell = Text(r.error, style="red")
        else:
            cell = Text()
            for i, (name, value) in enumerate(sorted(r.settings.items())):
                line = f"{name} = {json.dumps(value)}"
                cell.append(("\n" if i else "") + line, style="bold" if name in r.changed else "")
        table.add_row(_plain(r.host), _plain(r.role), _plain(r.address or "-"), cell)
    return table

"""Rich tables for fleet results; nothing here computes anything."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.table import Table
from rich.text import Text

from disagg.fleet.deploy import HostDeploy
from disagg.fleet.operations import AgentAction, AgentStatus, LogLine
from disagg.fleet.ssh import HostResult
from disagg.units import fmt

STATE_STYLE = {
    "healthy": "green",
    "stopped": "yellow",
    "starting": "cyan",
    "not responding": "red",
    "unreachable": "red",
    "not deployed": "yellow",
}


def _error(text: str) -> str:
    return f"[red]{text}[/]"


def deploy_table(results: list[HostResult[HostDeploy]], dry_run: bool = False) -> Table:
    title = "deploy (dry run: nothing changed)" if dry_run else "deploy"
    table = Table(title=title, header_style="bold")
    for col in ("host", "platform", "service", "python", "agents", "config", "result"):
        table.add_column(col, overflow="fold")
    for r in results:
        d = r.value
        if d is None:
            table.add_row(r.host, "", "", "", "", "", _error(r.error or "failed"))
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
        table.add_row(
            r.host, d.platform, d.service, d.python, files, config, f"[green]ok[/] {done}".strip()
        )
    return table


def actions_table(results: list[HostResult[list[AgentAction]]], title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("host", "role", "result", "detail"):
        table.add_column(col, overflow="fold")
    for r in results:
        if r.value is None:
            table.add_row(r.host, "", "[red]failed[/]", _error(r.error or ""))
            continue
        if not r.value:
            table.add_row(r.host, "", "-", "no agents placed here")
        for a in r.value:
            table.add_row(a.host, a.role, f"[green]{a.action}[/]", a.detail)
    return table


def _mem(rss_bytes: int | None) -> str:
    return "-" if rss_bytes is None else f"{rss_bytes / 2**20:,.0f} MiB"


def _prefix_cache(st: dict[str, Any]) -> str:
    """Hit rate over lookups, then bytes held of the budget (agents' /status)."""
    pc = st.get("prefix_cache")
    if not isinstance(pc, dict):
        return "-"
    rate = pc.get("hit_rate")
    hits = "-" if rate is None else f"{100 * rate:.0f}%"
    size = f"{_mem(pc.get('bytes'))} / {_mem(pc.get('max_bytes'))}"
    return f"hit {hits} of {fmt(pc.get('queries'))}\n{size}"


def status_table(rows: list[AgentStatus]) -> Table:
    table = Table(title="fleet status", header_style="bold")
    cols = ("host", "role", "state", "model", "loaded", "backend/device", "address",
            "uptime", "requests", "ttft", "prefix cache", "memory")  # fmt: skip
    for col in cols:
        table.add_column(col, overflow="fold")
    for s in rows:
        st = s.status
        state = Text(s.state, style=STATE_STYLE.get(s.state, ""))
        if s.detail and not s.ok:
            state.append(f"\n{s.detail}", style="dim")
        if s.ssh_error:
            state.append(f"\nbut ssh failed: {s.ssh_error}", style="red")
        model = str(st.get("model", "-")).rstrip("/").rsplit("/", 1)[-1]
        backend = f"{st['backend']}/{st.get('device')}" if st.get("backend") else "-"
        # One line per percentile: narrow enough for an 80-column terminal.
        ttft = "\n".join(f"p{p} {fmt(st.get(f'ttft_p{p}_s'), 's')}" for p in (50, 95, 99))
        table.add_row(
            s.host,
            s.role,
            state,
            model,
            fmt(st.get("loaded")),
            backend,
            s.address or "-",
            fmt(st.get("uptime_s"), "s"),
            fmt(st.get("requests")),
            ttft if st else "-",
            _prefix_cache(st),
            _mem(s.rss_bytes),
        )
    return table


def status_json(rows: list[AgentStatus]) -> list[dict[str, Any]]:
    return [{**dataclasses.asdict(s), "ok": s.ok} for s in rows]


def log_line(line: LogLine, width: int) -> Text:
    prefix = f"{line.host}/{line.role}" if line.role else line.host
    text = Text(f"{prefix:<{width}} | ", style="bold red" if line.error else "dim")
    text.append(line.text, style="red" if line.error else "")
    return text

"""The fleet commands: deploy, start, stop, restart, status, logs, tune.

Each command parses, calls the library (disagg.fleet) and renders
(render_fleet). Exit 1 if any host failed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any

import typer

from disagg.cli.common import Inventory, Json, app, err, friendly, out
from disagg.cli.plain import plain_lines

HostsArg = Annotated[
    list[str] | None,
    typer.Argument(help="Inventory host names (default: all).", show_default=False),
]


def _say_host(host: str, msg: str) -> None:
    # Deploy's progress quotes remote output: plain text, never markup.
    err.print(plain_lines(f"{host}: {msg}", None, style="dim"), highlight=False)


def _fail_if_any(results: list[Any]) -> None:
    if any(not r.ok for r in results):
        raise typer.Exit(1)


@app.command()
@friendly
def deploy(
    hosts: HostsArg = None,
    inventory: Inventory = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would change; change nothing.")
    ] = False,
    as_json: Json = False,
) -> None:
    """Upload the agents to the hosts and install them as services."""
    from disagg.cli.render_fleet import deploy_table
    from disagg.fleet import deploy as d
    from disagg.fleet.inventory import load

    inv = load(inventory)
    results = d.deploy(inv, hosts, dry_run=dry_run, say=_say_host)
    if as_json:
        print(json.dumps([_plain(r) for r in results]))
    else:
        out.print(deploy_table(results, dry_run))
    _fail_if_any(results)


def _lifecycle(op: str, hosts: list[str] | None, inventory: str | None) -> None:
    from disagg.cli.render_fleet import actions_table
    from disagg.fleet import operations as fleet
    from disagg.fleet.inventory import load

    inv = load(inventory)
    results = getattr(fleet, op)(inv, hosts, say=_say_host)
    out.print(actions_table(results, op))
    _fail_if_any(results)


@app.command()
@friendly
def start(hosts: HostsArg = None, inventory: Inventory = None) -> None:
    """Start the deployed agents; waits until each is ready."""
    _lifecycle("start", hosts, inventory)


@app.command()
@friendly
def stop(hosts: HostsArg = None, inventory: Inventory = None) -> None:
    """Stop the agents."""
    _lifecycle("stop", hosts, inventory)


@app.command()
@friendly
def restart(hosts: HostsArg = None, inventory: Inventory = None) -> None:
    """Stop and start the agents."""
    _lifecycle("restart", hosts, inventory)


@app.command()
@friendly
def status(
    hosts: HostsArg = None,
    inventory: Inventory = None,
    as_json: Json = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls.")] = 2.0,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help="A running gateway's agents instead (disagg serve --local: "
            "http://127.0.0.1:8080); the operator's key from DISAGG_API_KEY.",
        ),
    ] = None,
) -> None:
    """Health of every agent: a table, or --json. Exit 1 if any is not healthy."""
    from disagg.cli.render_fleet import status_json, status_table
    from disagg.fleet import operations as fleet
    from disagg.fleet.inventory import load

    if url is not None:
        _gateway_status(url, as_json)
        return

    inv = load(inventory)
    if watch and not as_json:
        from rich.live import Live

        with Live(status_table(fleet.status(inv, hosts), out.width), console=out) as live:
            while True:
                time.sleep(interval)
                live.update(status_table(fleet.status(inv, hosts), out.width))
    rows = fleet.status(inv, hosts)
    if as_json:
        print(json.dumps(status_json(rows)))
    else:
        out.print(status_table(rows, out.width))
    if any(not r.ok for r in rows):
        raise typer.Exit(1)


def _gateway_status(url: str, as_json: bool) -> None:
    import os

    from disagg.serving.gatewaystatus import gateway_agents

    rows = gateway_agents(url, os.environ.get("DISAGG_API_KEY"))
    if as_json:
        print(json.dumps(rows))
    else:
        for shown in gateway_tables(rows, url, out.width):
            out.print(shown)
    if any(not r.get("up") for r in rows):
        raise typer.Exit(1)


GATEWAY_COLS = ("agent", "role", "model", "state", "device", "requests", "ttft p50", "disk")


def gateway_cells(r: dict[str, Any]) -> list[str]:
    from disagg.cli.render_fleet import disk_tier
    from disagg_agents.wire.status import AgentStatus

    # A row carries its agent's /status fields by their own names: read typed.
    st = AgentStatus.from_json(r)
    p50 = st.ttft_p50_s
    return [
        *(str(r.get(k) or "-") for k in ("name", "role")),
        str(st.model or "-"),
        "up" if r.get("up") else f"down: {r.get('error') or '?'}",
        str(st.device or "-"),
        str(st.requests if st.requests is not None else "-"),
        f"{p50 * 1000:.0f} ms" if p50 is not None else "-",
        disk_tier(st.prefix_disk),  # a decode agent's, where it has one
    ]


def gateway_tables(rows: list[dict[str, Any]], url: str, width: int) -> list[Any]:
    """The gateway's agents, one line each: every column where they fit `width`; in
    an 80-column terminal role and device go under the table, and no agent's name
    wraps (only a down agent's reason may)."""
    from rich.table import Table
    from rich.text import Text

    cells = [gateway_cells(r) for r in rows]
    keep = list(range(len(GATEWAY_COLS)))
    up_cells = [c for c in cells if c[3] == "up"]
    widths = [max([len(col), *(len(c[i]) for c in up_cells)]) for i, col in enumerate(GATEWAY_COLS)]
    narrow = sum(widths) + 3 * len(keep) + 1 > width
    if narrow:
        keep = [0, 2, 3, 5, 6]
    table = Table(title=f"agents behind {url}", header_style="bold")
    for i in keep:
        table.add_column(GATEWAY_COLS[i], no_wrap=i in (0, 5, 6), overflow="fold")
    for c in cells:
        state = Text(c[3], style="" if c[3] == "up" else "red")
        table.add_row(*(state if i == 3 else Text(c[i]) for i in keep))
    if not narrow:
        return [table]
    under = "\n".join(
        f"{c[0]}: {c[1]} on {c[4]}" + (f", disk {c[7]}" if c[7] != "-" else "") for c in cells
    )
    return [table, Text(under, no_wrap=False)]


@app.command()
@friendly
def logs(
    hosts: HostsArg = None,
    inventory: Inventory = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Follow new lines.")] = False,
    lines: Annotated[int, typer.Option("-n", "--lines", help="Lines per agent.")] = 50,
) -> None:
    """The agents' logs, all hosts interleaved, each line prefixed by host/role.

    Lines from an agent's stderr (a crash's traceback) are marked ! and shown in red."""
    from disagg.cli.render_fleet import log_line
    from disagg.fleet import operations as fleet
    from disagg.fleet.inventory import load

    inv = load(inventory)
    chosen = inv.select(hosts)
    width = max((len(f"{h.name}/prefill") for h in chosen), default=10)
    failed = False
    for line in fleet.logs(inv, hosts, n=lines, follow=follow):
        failed |= line.error
        out.print(log_line(line, width), soft_wrap=True, highlight=False)
    if failed:
        raise typer.Exit(1)


@app.command()
@friendly
def tune(
    hosts: HostsArg = None,
    inventory: Inventory = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="NAME=VALUE to change on the running agents (repeat); none: show them.",
            show_default=False,
        ),
    ] = None,
    role: Annotated[
        str | None, typer.Option("--role", help="Only the prefill or the decode agents.")
    ] = None,
    as_json: Json = False,
) -> None:
    """Show or change the agents' live settings, without a restart.

    Connection caps, handshake deadline, prefix-cache budget, ...; a restart goes
    back to the inventory's."""
    from disagg.cli.render_fleet import tune_table
    from disagg.fleet.inventory import load
    from disagg.fleet.tune import parse_changes
    from disagg.fleet.tune import tune as tune_agents

    changes = parse_changes(set_ or [])
    inv = load(inventory)
    rows = tune_agents(inv, hosts, changes, role)
    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        out.print(tune_table(rows, bool(changes)))
    if any(not r.ok for r in rows):
        raise typer.Exit(1)


def _plain(result: Any) -> dict[str, Any]:
    value = dataclasses.asdict(result.value) if result.value is not None else None
    return {"host": result.host, "ok": result.ok, "error": result.error, "result": value}

"""Route requests to the fleet an inventory describes: the decode agent this machine
reaches, and the prefill agent's data-plane addresses (fastest first) that the
decode agent dials in order, so a cut fast link falls back to the switch."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from disagg.errors import ConnectError
from disagg.fleet.inventory import Host, Inventory, load
from disagg.fleet.token import load_token
from disagg.serving import wireclient as client
from disagg.serving.router import Endpoint, Route, Router

PROBE_TIMEOUT_S = 1.0


class RequestTarget(NamedTuple):
    decode_host: str  # the address this machine reaches the decode agent on
    decode_port: int
    prefill: dict[str, Any]  # the request's "prefill" field: hosts (fastest first), port, ...
    decode_timeout_s: float = 180.0


def reachable_here(addresses: list[str], port: int) -> str | None:
    """The first address, in order, that accepts a TCP connection on `port` from here."""
    for addr in addresses:
        try:
            socket.create_connection((addr, port), timeout=PROBE_TIMEOUT_S).close()
            return addr
        except OSError:
            continue
    return None


def prefill_target(host: Host, timeout_s: float) -> dict[str, Any]:
    addrs = host.addresses()
    return {
        "hosts": addrs,
        "host": addrs[0] if addrs else host.ssh,  # for agents that read one address
        "port": host.roles["prefill"].port,
        "timeout": timeout_s,
        "name": f"prefill@{host.name}",
    }


def fleet_request_target(inv: Inventory, model: str) -> RequestTarget:
    """The first decode agent of `model`'s pipeline that answers from here, and the
    pipeline's first prefill agent with its data-plane addresses, fastest first."""
    p = inv.pipeline_for(model)
    tried: list[str] = []
    for name in p.decode:
        dhost = inv.hosts[name]
        dport = dhost.roles["decode"].port
        addr = reachable_here(dhost.addresses(), dport)
        if addr is not None:
            target = prefill_target(inv.hosts[p.prefill[0]], p.prefill_timeout)
            return RequestTarget(addr, dport, target, p.decode_timeout)
        tried.append(f"{name} at {', '.join(dhost.addresses()) or dhost.ssh} port {dport}")
    raise ConnectError(
        f"no decode agent of pipeline {p.name!r} answers (tried {'; '.join(tried)}); "
        "fix: disagg status, then disagg start"
    )


def generate_on_fleet(
    inv: Inventory,
    model: str,
    request: dict[str, Any],
    on_text: Callable[[str], None] | None = None,
) -> client.Result:
    """Send `request` (prompt, max_tokens, ...) through the pipeline serving `model`."""
    target = fleet_request_target(inv, model)
    req = {**request, "prefill": target.prefill}
    return client.generate(
        target.decode_host,
        target.decode_port,
        req,
        on_text,
        timeout_s=target.decode_timeout_s,
        token=load_token(inv.path),
    )


def router_from_inventory(inventory: str | Path | Inventory | None = None) -> Router:
    """An orchestrator Router over the inventory's pipelines (and their aliases)."""
    inv = inventory if isinstance(inventory, Inventory) else load(inventory)
    pipelines = []
    for p in inv.pipelines.values():
        prefill = [_endpoint(inv.hosts[h], "prefill") for h in p.prefill]
        decode = [_endpoint(inv.hosts[h], "decode") for h in p.decode]
        for name in (p.name, *p.aliases):
            pipelines.append(Route(name, prefill, decode, p.prefill_timeout, p.decode_timeout))
    return Router(pipelines, token=load_token(inv.path))


def _endpoint(host: Host, role: str) -> Endpoint:
    ports = host.roles[role]
    addrs = host.addresses() or [host.ssh]
    # Decode agents are dialled from here: use the first address that answers now.
    here = reachable_here(addrs, ports.port) if role == "decode" else None
    return Endpoint(f"{role}@{host.name}", here or addrs[0], ports.port, ports.control_port, addrs)

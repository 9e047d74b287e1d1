"""The router over the fleet an inventory describes: decode agents at the address
this machine reaches them on, prefill agents with their data-plane addresses
(fastest first) that a decode agent dials in order, so a cut fast link falls back
to the switch."""

from __future__ import annotations

import socket
from pathlib import Path

from disagg.fleet.inventory import Host, Inventory, load
from disagg.fleet.token import load_token
from disagg.serving.router import Endpoint, Route, Router

PROBE_TIMEOUT_S = 1.0


def reachable_here(addresses: list[str], port: int) -> str | None:
    """The first address, in order, that accepts a TCP connection on `port` from here."""
    for addr in addresses:
        try:
            socket.create_connection((addr, port), timeout=PROBE_TIMEOUT_S).close()
            return addr
        except OSError:
            continue
    return None


def router_from_inventory(inventory: str | Path | Inventory | None = None) -> Router:
    """An orchestrator Router over the inventory's pipelines (and their aliases)."""
    inv = inventory if isinstance(inventory, Inventory) else load(inventory)
    pipelines = []
    for p in inv.pipelines.values():
        # An embedding pipeline's prefill agents are dialled from here, as decode agents are.
        prefill = [_endpoint(inv.hosts[h], "prefill", p.embedding) for h in p.prefill]
        decode = [_endpoint(inv.hosts[h], "decode") for h in p.decode]
        for name in (p.name, *p.aliases):
            pipelines.append(
                Route(
                    name,
                    prefill,
                    decode,
                    p.prefill_timeout,
                    p.decode_timeout,
                    p.integrity,
                    p.max_migrations,
                    embedding_only=p.embedding,
                )
            )
    return Router(pipelines, token=load_token(inv.path))


def _endpoint(host: Host, role: str, dialled_here: bool = False) -> Endpoint:
    ports = host.roles[role]
    addrs = host.addresses() or [host.ssh]
    # Decode agents are dialled from here: use the first address that answers now.
    here = reachable_here(addrs, ports.port) if role == "decode" or dialled_here else None
    return Endpoint(f"{role}@{host.name}", here or addrs[0], ports.port, ports.control_port, addrs)

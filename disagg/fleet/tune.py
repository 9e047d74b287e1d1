"""`disagg tune`: read or change the fleet's agents' live settings (PUT /settings)
without a restart, so the models stay loaded and the prefix caches warm.

A change lasts until the agent restarts; the inventory's flags are what a start
gives. Each agent is reached on its control port, proving the cluster token by
challenge-response, the change's body signed with it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from disagg.errors import UsageError
from disagg.fleet.inventory import Agent, Inventory
from disagg.fleet.token import load_token
from disagg.serving.control import agent_settings
from disagg_agents.wire.frames import PeerAuthError
from disagg_agents.wire.text import printable

HTTP_TIMEOUT_S = 5.0


@dataclass
class Tuned:
    host: str
    role: str
    address: str = ""  # where it answered: ADDR:PORT
    settings: dict[str, Any] = field(default_factory=dict)  # after the change
    changed: list[str] = field(default_factory=list)  # names whose value the change set
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def parse_changes(pairs: list[str]) -> dict[str, Any]:
    """NAME=VALUE pairs as a change: a JSON value (64, 1.5, true) or else the text."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, eq, raw = pair.partition("=")
        if not eq or not name.strip():
            raise UsageError(f"--set takes NAME=VALUE (e.g. max_connections=64), not {pair!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        changes[name.strip()] = value
    return changes


def _tune(agent: Agent, token: bytes | None, changes: dict[str, Any]) -> Tuned:
    row = Tuned(agent.host.name, agent.role)
    port = agent.ports.control_port
    addresses = agent.host.addresses()
    for addr in addresses:
        try:
            row.settings = agent_settings(addr, port, token, changes, HTTP_TIMEOUT_S)
        except (PeerAuthError, ValueError) as e:  # it answered: refused us, or the change
            row.address, row.error = f"{addr}:{port}", printable(e, 300)
            return row
        except OSError:
            continue
        row.address, row.changed = f"{addr}:{port}", list(changes)
        return row
    tried = ", ".join(addresses) or "no address"
    row.error = f"control port {port} not reachable from here ({tried}): is it started?"
    return row


def tune(
    inv: Inventory,
    hosts: list[str] | None = None,
    changes: dict[str, Any] | None = None,
    role: str | None = None,
) -> list[Tuned]:
    """Each selected agent's settings after `changes` (none: as they are), all at once."""
    if role not in (None, "prefill", "decode"):
        raise UsageError(f"--role is prefill or decode, not {role!r}")
    chosen = [a for a in inv.agents(inv.select(hosts)) if role in (None, a.role)]
    token = load_token(inv.path)
    if not chosen:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(chosen))) as pool:
        return list(pool.map(lambda a: _tune(a, token, changes or {}), chosen))

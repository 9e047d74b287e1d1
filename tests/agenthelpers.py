"""Helpers the tests share for reading a running agent: its /status typed (as
the control plane reads it), its router endpoint, its memory, a socket's state;
and a fixed /status for a control port a test starts alone."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.serving.localagents import AgentProc
from disagg.serving.router import Endpoint
from disagg_agents.wire.status import AgentStatus


@dataclass(frozen=True)
class FixedStatus:
    """A /status a test's control port serves as given (no agent behind it)."""

    doc: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return self.doc


def status_of(agent: AgentProc) -> AgentStatus:
    """The agent's /status, typed."""
    return AgentStatus.from_json(agent.status())


def in_flight(agent: AgentProc) -> int:
    """Requests under way on the agent now."""
    return status_of(agent).in_flight or 0


def cache_status(agent: AgentProc) -> dict[str, Any]:
    """The agent's prefix cache document whole (prefix.store's snapshot)."""
    doc: dict[str, Any] = agent.status()["prefix_cache"]
    return doc


def endpoint(agent: AgentProc) -> Endpoint:
    """The agent as the router's Endpoint."""
    return Endpoint(agent.name, agent.host, agent.port, agent.control_port)


def rss_kb(agent: AgentProc) -> int:
    """The agent process's resident memory, in KiB (Linux)."""
    for line in Path(f"/proc/{agent.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def closed_now(s: socket.socket) -> bool:
    """The peer closed (or reset) `s`, without waiting."""
    s.setblocking(False)  # with a timeout set, Python polls for it before any recv
    try:
        return s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def shared_len(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

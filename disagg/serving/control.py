"""An agent's HTTP control endpoints (/health, /status, /metrics, /settings) as data.

The request itself is `disagg_agents.wire.httpauth.control_get`: it proves the cluster token
by challenge-response, so the token never crosses the wire. Local agents, fleet
status and the benchmarks all read /status through `control_status`.
"""

from __future__ import annotations

import json
from typing import Any

from disagg_agents.wire.httpauth import ControlError, control_get, control_put
from disagg_agents.wire.status import AgentStatus
from disagg_agents.wire.text import printable


def parse_status(raw: bytes | str) -> dict[str, Any]:
    """An agent's /status answer as a dict; ValueError saying what is wrong
    (not JSON, not an object, nested past reason)."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ValueError("/status answer nests JSON too deeply") from None
    except ValueError as e:
        raise ValueError(f"/status answer is not JSON: {printable(e, 80)}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"/status answer is JSON {type(obj).__name__}, not an object")
    return obj


def control_status(
    host: str, control_port: int, token: bytes | None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """The agent's /status document. Raises OSError (no answer), disagg_agents.wire's
    AuthError (token refused) or ValueError (a malformed answer)."""
    return parse_status(control_get(host, control_port, "/status", token, timeout_s))


def agent_status(
    host: str, control_port: int, token: bytes | None, timeout_s: float = 5.0
) -> AgentStatus:
    """The agent's /status, typed (AgentStatus); raises as control_status does."""
    return AgentStatus.from_json(control_status(host, control_port, token, timeout_s))


def agent_settings(
    host: str,
    control_port: int,
    token: bytes | None,
    changes: dict[str, Any] | None = None,
    timeout_s: float = 5.0,
) -> dict[str, Any]:
    """The agent's live settings, after applying `changes` (PUT /settings) when given.
    Raises ValueError with the agent's one line for a change it refused, OSError /
    AuthError as control_status does."""
    try:
        if changes:
            raw = control_put(
                host, control_port, "/settings", token, json.dumps(changes).encode(), timeout_s
            )
        else:
            raw = control_get(host, control_port, "/settings", token, timeout_s)
    except ControlError as e:
        if e.status != 400:
            raise
        try:
            why = json.loads(e.body)["error"]
        except (ValueError, KeyError, TypeError):
            why = e.body.decode(errors="replace")
        raise ValueError(printable(why, 300)) from None
    settings = parse_status(raw).get("settings")
    if not isinstance(settings, dict):
        raise ValueError("/settings answer has no settings object")
    return settings

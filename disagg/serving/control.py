"""GET an agent's HTTP control endpoints (/health, /status, /metrics).

The one place a control request presents the cluster token: local agents,
fleet status and the benchmarks all call `control_get`, so how the token is
shown to the agent changes here and nowhere else.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def control_get(
    host: str, control_port: int, path: str, token: bytes | None, timeout_s: float = 5.0
) -> bytes:
    """The body of GET `path` on an agent's control port, authenticated with `token`.

    Raises OSError (urllib's errors, HTTP 401 included) when it does not answer 200.
    """
    req = urllib.request.Request(f"http://{host}:{control_port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token.decode()}")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return bytes(resp.read())


def control_status(
    host: str, control_port: int, token: bytes | None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """The agent's own /status document; OSError or ValueError when it cannot be had."""
    return dict(json.loads(control_get(host, control_port, "/status", token, timeout_s)))

"""A running gateway's agents, as its web view sees them (`GET /ui/api/state`):
what `disagg status --url` shows for `disagg serve --local`, whose agents no
inventory lists."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from disagg.errors import ConnectError, UsageError


def gateway_agents(url: str, key: str | None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The gateway's agent rows (name, role, model, up, device, requests, ...).
    Raises ConnectError when it cannot be reached, UsageError for a refused key."""
    req = urllib.request.Request(url.rstrip("/") + "/ui/api/state")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            if not key:
                raise UsageError(
                    f"{url} needs an API key: set DISAGG_API_KEY to the operator's "
                    "(the first key serve was given)"
                ) from None
            raise UsageError(
                f"{url} refused the key in DISAGG_API_KEY: give the operator's "
                "(the first key serve was given)"
            ) from None
        raise ConnectError(f"{url} answered HTTP {e.code}") from None
    except (OSError, ValueError) as e:
        raise ConnectError(f"cannot reach the gateway at {url}: {e}") from None
    if not body.get("operator"):
        raise UsageError(f"{url}: only the operator's key (the first) sees the agents")
    return list(body.get("agents") or [])

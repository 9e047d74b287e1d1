"""What a served model's decode agents say about it (their /status: architecture,
context, dtype, chat template and capabilities), fetched on demand and kept for a
short while: read by every front door (Ollama's /api/show, Anthropic's thinking)."""

from __future__ import annotations

import threading
import time
from typing import Any

from disagg.api import Client
from disagg.serving.control import control_status
from disagg_agents.wire.frames import AuthError

INFO_TTL_S = 30.0


class ModelInfo:
    """What the decode agents say about each model (architecture, context,
    dtype), fetched from their /status and kept for a short while."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self.lock = threading.Lock()

    def get(self, name: str) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            hit = self.cache.get(name)
        if hit and now - hit[0] < INFO_TTL_S:
            return hit[1]
        info: dict[str, Any] = {}
        router = self.client.router
        pipe = router.pipeline(name)
        # An embedding pipeline has no decode side: its prefill agents say it.
        for ep in pipe.decode or pipe.prefill:
            if ep.control_port is None:
                continue
            try:
                info = control_status(ep.host, ep.control_port, router.token, timeout_s=2.0)
                break
            except (OSError, ValueError, AuthError):
                continue
        if pipe.embedding_only:  # /api/show's capabilities, fetched or not
            info = {**info, "embedding_only": True}
        if info and (len(info) > 1 or not pipe.embedding_only):
            # a failed fetch is never kept: the next request asks again
            with self.lock:
                self.cache[name] = (now, info)
        return info

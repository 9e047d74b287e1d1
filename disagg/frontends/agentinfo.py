"""What a served model's decode agents say about it (their /status: architecture,
context, dtype, chat template and capabilities), fetched on demand and kept for a
short while: read by every front door (Ollama's /api/show, Anthropic's thinking)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from disagg.api import Client
from disagg.serving.control import agent_status
from disagg_agents.wire.frames import PeerAuthError
from disagg_agents.wire.status import AgentStatus

INFO_TTL_S = 30.0


@dataclass(frozen=True)
class About:
    """A served model as its agents describe it: one agent's /status (empty when
    none answered) and whether the pipeline embeds only (it has no decode side)."""

    status: AgentStatus = field(default_factory=AgentStatus)
    embedding_only: bool = False


class ModelInfo:
    """What the decode agents say about each model (architecture, context,
    dtype), fetched from their /status and kept for a short while."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.cache: dict[str, tuple[float, About]] = {}
        self.lock = threading.Lock()

    def get(self, name: str) -> About:
        now = time.monotonic()
        with self.lock:
            hit = self.cache.get(name)
        if hit and now - hit[0] < INFO_TTL_S:
            return hit[1]
        status: AgentStatus | None = None
        router = self.client.router
        pipe = router.pipeline(name)
        # An embedding pipeline has no decode side: its prefill agents say it.
        for ep in pipe.decode or pipe.prefill:
            if ep.control_port is None:
                continue
            try:
                status = agent_status(ep.host, ep.control_port, router.token, timeout_s=2.0)
                break
            except (OSError, ValueError, PeerAuthError):
                continue
        about = About(status or AgentStatus(), pipe.embedding_only)
        if status is not None and status.doc:
            # a failed fetch is never kept: the next request asks again
            with self.lock:
                self.cache[name] = (now, about)
        return about

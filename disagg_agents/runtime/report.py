"""An agent's /status as the agent builds it, typed: one object per role, turned
into JSON once, by the control port (disagg_agents.runtime.control). The
document is the one the agents sent as a dict; the control plane reads it back
with disagg_agents.wire.status. Nested documents (the counters, the caches, the
queues) are their own modules' snapshots, kept as those modules write them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from disagg_agents.wire.status import MoePath


class StatusReport(Protocol):
    """What the control port serves as /status."""

    def as_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class DecodeStatus:
    """The decode agent's /status: what it runs, its batch, its counters, its caches."""

    name: str
    model: str  # the model directory on this host
    device: str  # as mlx names it
    blas: str  # disagg_agents.runtime.fastblas.loaded
    blas_threads: int | None  # None: mlx's own BLAS
    blas_limited_by: str | None  # why fewer threads than the machine's; None: every thread
    fingerprint: dict[str, Any]
    context: int  # the model's context length, in tokens
    queued: int  # requests waiting for a batch slot
    max_batch: int
    batch: dict[str, int]  # the batch loop's snapshot, flat in the document
    stats: dict[str, Any]  # runtime.metrics.Stats' snapshot, flat in the document
    prefix_cache: dict[str, Any]
    prefix_disk: dict[str, Any] | None  # None: no disk tier
    grammars: dict[str, int]
    chat: dict[str, Any]  # for /api/show: capabilities, template, stops

    def as_json(self) -> dict[str, Any]:
        return {
            "role": "decode",
            "name": self.name,
            "model": self.model,
            "loaded": True,
            "backend": "mlx",
            "device": self.device,
            "blas": self.blas,
            "blas_threads": self.blas_threads,
            "blas_limited_by": self.blas_limited_by,
            "fingerprint": self.fingerprint,
            "context": self.context,
            "queued": self.queued,
            "max_batch": self.max_batch,
            **self.batch,
            **self.stats,
            "prefix_cache": self.prefix_cache,
            "prefix_disk": self.prefix_disk,
            "grammars": self.grammars,
            "chat": self.chat,
        }


@dataclass(frozen=True)
class PrefillStatus:
    """The prefill agent's /status: what it runs, its counters, its cache and queue,
    the K/V it is still sending."""

    name: str
    model: str  # the model directory on this host
    device: str  # as torch names it
    fingerprint: dict[str, Any]
    moe_paths: Sequence[MoePath]  # each MoE layer's GEMM path (empty: dense)
    stats: dict[str, Any]  # runtime.metrics.Stats' snapshot, flat in the document
    prefix_cache: dict[str, Any]
    queue: dict[str, Any]  # the compute slots' snapshot
    kv_send: dict[str, Any]  # requests still sending K/V

    def as_json(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "name": self.name,
            "model": self.model,
            "loaded": True,
            "backend": "torch",
            "device": self.device,
            "fingerprint": self.fingerprint,
            "moe_paths": [m.as_dict() for m in self.moe_paths],
            **self.stats,
            "prefix_cache": self.prefix_cache,
            "queue": self.queue,
            "kv_send": self.kv_send,
        }

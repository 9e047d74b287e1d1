"""An agent's /status as the control plane reads it, typed once.

The agents serve /status as a JSON object they build as a dict (each role adds
its own fields); `AgentStatus.from_json` reads the fields the control plane uses
(the web view's fleet cards, the gateway's batch capacity, the model facts
/api/show and Anthropic's thinking ask for). A field of the wrong type reads as
None (or empty): an agent of another release, or a hostile one, costs its own
field only. `doc` keeps the whole document as sent, for what prints it whole
(`disagg status --json`). Stdlib only: agents ship alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | int | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _obj(v: Any) -> dict[str, Any]:
    return dict(v) if isinstance(v, Mapping) else {}


def _maybe_obj(v: Any) -> dict[str, Any] | None:
    """An object the agent may leave out: None when absent or mistyped."""
    return dict(v) if isinstance(v, Mapping) else None


@dataclass(frozen=True)
class MoePath:
    """Which grouped GEMM one MoE layer of a prefill agent takes for a long prompt
    on its device, and why, when that is slower than the device's best."""

    layer: int  # the decoder layer's index
    path: str  # triton | grouped | blocked
    best: str  # the device's fastest path for this model
    reason: str = ""  # why `path` is not `best` ("" when it is, or as fast)

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "path": self.path, "best": self.best, "reason": self.reason}

    @classmethod
    def from_json(cls, v: Any) -> MoePath | None:
        if not isinstance(v, Mapping):
            return None
        layer, path, best = _int(v.get("layer")), _str(v.get("path")), _str(v.get("best"))
        if layer is None or path is None or best is None:
            return None
        return cls(layer, path, best, _str(v.get("reason")) or "")


def _moe_paths(v: Any) -> tuple[MoePath, ...]:
    items = v if isinstance(v, list) else []
    return tuple(p for p in (MoePath.from_json(x) for x in items) if p is not None)


@dataclass(frozen=True)
class PrefixCacheStatus:
    """The prefix cache's document (disagg_agents.prefix.store's snapshot): the
    fields the control plane reads. The disk tier's is `AgentStatus.prefix_disk`."""

    hit_rate: float | int | None = None  # of lookups
    cached_tokens: int | None = None  # prompt tokens it served, every tier

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefixCacheStatus:
        return cls(hit_rate=_num(d.get("hit_rate")), cached_tokens=_int(d.get("cached_tokens")))


@dataclass(frozen=True)
class WeightsFormat:
    """What the fingerprint says of the weights: their dtype and, when quantized,
    the bits and mode (affine, mxfp4, ...)."""

    dtype: str | None = None
    bits: int | None = None
    mode: str | None = None

    @classmethod
    def from_fingerprint(cls, fp: Mapping[str, Any]) -> WeightsFormat:
        q = _obj(_obj(fp.get("weights")).get("quantization"))
        return cls(_str(fp.get("dtype")), _int(q.get("bits")), _str(q.get("mode")))


@dataclass(frozen=True)
class AgentStatus:
    """The fields of an agent's /status the control plane reads."""

    backend: str | None = None  # "mlx" (decode), "torch" (prefill)
    device: str | None = None  # as the framework names it: "Device(gpu, 0)", "cuda"
    model: str | None = None  # the model directory on the agent's host
    context: int | None = None  # the model's context length, in tokens
    in_flight: int | None = None  # requests under way now
    queued: int | None = None  # ... of them waiting for a batch slot
    batch: int | None = None  # sequences decoding together now
    max_batch: int | None = None  # the most it decodes together
    requests: int | None = None  # since it started
    errors: int | None = None
    cancelled: int | None = None
    uptime_s: float | int | None = None
    rss_bytes: int | None = None
    ttft_p50_s: float | int | None = None
    # Nested documents, read by their own readers: the weights' fingerprint
    # (architecture, dtype, layers, weights.quantization), the chat template's facts
    # (capabilities, template, stop, tool_format, reasoning, fim_tokens), the prefix
    # cache (hit_rate, cached_tokens) and disk tier, the last request's error.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    chat: dict[str, Any] | None = None  # None: the agent sent none (an older release)
    prefix_cache: dict[str, Any] = field(default_factory=dict)
    prefix_disk: dict[str, Any] | None = None
    last_error: dict[str, Any] | None = None
    # A prefill agent's MoE layers, each with the GEMM path it takes (empty: dense).
    moe_paths: tuple[MoePath, ...] = ()
    # The nested documents' fields read, typed.
    prefix_stats: PrefixCacheStatus = field(default_factory=PrefixCacheStatus)
    weights_format: WeightsFormat = field(default_factory=WeightsFormat)
    doc: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AgentStatus:
        """The /status object as sent; what is missing or mistyped reads as None."""
        return cls(
            backend=_str(d.get("backend")),
            device=None if d.get("device") is None else str(d.get("device")),
            model=_str(d.get("model")),
            context=_int(d.get("context")),
            in_flight=_int(d.get("in_flight")),
            queued=_int(d.get("queued")),
            batch=_int(d.get("batch")),
            max_batch=_int(d.get("max_batch")),
            requests=_int(d.get("requests")),
            errors=_int(d.get("errors")),
            cancelled=_int(d.get("cancelled")),
            uptime_s=_num(d.get("uptime_s")),
            rss_bytes=_int(d.get("rss_bytes")),
            ttft_p50_s=_num(d.get("ttft_p50_s")),
            fingerprint=_obj(d.get("fingerprint")),
            chat=_maybe_obj(d.get("chat")),
            prefix_cache=_obj(d.get("prefix_cache")),
            prefix_disk=_maybe_obj(d.get("prefix_disk")),
            last_error=_maybe_obj(d.get("last_error")),
            moe_paths=_moe_paths(d.get("moe_paths")),
            prefix_stats=PrefixCacheStatus.from_json(_obj(d.get("prefix_cache"))),
            weights_format=WeightsFormat.from_fingerprint(_obj(d.get("fingerprint"))),
            doc=dict(d),
        )


# The names a string-key read of /status would use (tests/test_layout.py holds the
# control plane to reading them by attribute).
STATUS_FIELDS = frozenset(f.name for f in fields(AgentStatus)) - {"doc"}

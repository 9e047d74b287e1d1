"""An agent's /status as the control plane reads it, typed once.

The agents serve /status as a JSON object they build as a dict (each role adds
its own fields); `AgentStatus.from_json` reads the fields the control plane uses
(`disagg status`, the web view's fleet cards, the gateway's batch capacity, the
model facts /api/show and Anthropic's thinking ask for), nested documents by
their own readers. A field of the wrong type reads as None (or empty) and is
named in `mistyped` ("prefix_cache.bytes"): an agent of another release, or a
hostile one, costs its own field only, and `disagg status` can say which. `doc`
keeps the whole document as sent, for what prints it whole (`disagg status
--json`). Stdlib only: agents ship alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _int(v: Any) -> int | None:
    return v if _is_int(v) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _obj(v: Any) -> dict[str, Any]:
    return dict(v) if isinstance(v, Mapping) else {}


class _Fields:
    """One JSON object's fields read by type. A field sent as null reads as absent;
    one of another type reads as None and its name joins `mistyped`."""

    def __init__(self, d: Mapping[str, Any]) -> None:
        self.d = d
        self.mistyped: list[str] = []

    def take(self, key: str, ok: Callable[[Any], bool]) -> Any:
        v = self.d.get(key)
        if v is None or ok(v):
            return v
        self.mistyped.append(key)
        return None

    def count(self, key: str) -> int | None:
        return self.take(key, _is_int)

    def number(self, key: str) -> float | int | None:
        return self.take(key, _is_num)

    def text(self, key: str) -> str | None:
        return self.take(key, lambda v: isinstance(v, str))

    def flag(self, key: str) -> bool | None:
        return self.take(key, lambda v: isinstance(v, bool))

    def texts(self, key: str) -> tuple[str, ...] | None:
        v = self.take(key, _is_strs)
        return None if v is None else tuple(v)

    def document(self, key: str) -> dict[str, Any] | None:
        v = self.take(key, lambda v: isinstance(v, Mapping))
        return None if v is None else dict(v)

    def nested(self, key: str, mistyped: tuple[str, ...]) -> None:
        """A nested document's own mistyped fields, named under its key."""
        self.mistyped += [f"{key}.{name}" for name in mistyped]

    def named(self) -> tuple[str, ...]:
        return tuple(self.mistyped)


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


def _moe_paths(f: _Fields) -> tuple[MoePath, ...]:
    """The entries that read; any that does not marks the field mistyped."""
    items = f.take("moe_paths", lambda v: isinstance(v, list)) or []
    paths = tuple(p for p in (MoePath.from_json(x) for x in items) if p is not None)
    if len(paths) < len(items):
        f.mistyped.append("moe_paths")
    return paths


@dataclass(frozen=True)
class PrefixCacheStatus:
    """The prefix cache's document (disagg_agents.prefix.store's snapshot): the
    fields the control plane reads."""

    hit_rate: float | int | None = None  # of lookups (None: none yet)
    queries: int | None = None  # lookups
    cached_tokens: int | None = None  # prompt tokens it served, every tier
    bytes: int | None = None  # held in memory
    max_bytes: int | None = None  # the memory budget
    mistyped: tuple[str, ...] = ()  # fields sent with another type

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefixCacheStatus:
        f = _Fields(d)
        return cls(
            hit_rate=f.number("hit_rate"),
            queries=f.count("queries"),
            cached_tokens=f.count("cached_tokens"),
            bytes=f.count("bytes"),
            max_bytes=f.count("max_bytes"),
            mistyped=f.named(),
        )


@dataclass(frozen=True)
class PrefixDiskStatus:
    """A decode agent's prefix disk tier (disagg_agents.prefix.disk's snapshot)."""

    hits: int | None = None  # lookups it served
    cached_tokens: int | None = None  # prompt tokens it served
    bytes: int | None = None  # held on disk
    max_bytes: int | None = None  # the disk budget
    corrupt: int | None = None  # files that failed their check and were dropped
    mistyped: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefixDiskStatus:
        f = _Fields(d)
        return cls(
            hits=f.count("hits"),
            cached_tokens=f.count("cached_tokens"),
            bytes=f.count("bytes"),
            max_bytes=f.count("max_bytes"),
            corrupt=f.count("corrupt"),
            mistyped=f.named(),
        )


def _is_fim(v: Any) -> bool:
    return _is_strs(v) and len(v) == 3


def _fim(v: list[str] | None) -> tuple[str, str, str] | None:
    return None if v is None else (v[0], v[1], v[2])


@dataclass(frozen=True)
class ChatFacts:
    """A decode agent's chat template facts (its engine's chat_info), for Ollama's
    /api/show and whether Anthropic's thinking reaches the model."""

    capabilities: tuple[str, ...] | None = None  # Ollama's: completion, tools, thinking, ...
    template: str | None = None  # the chat template's text
    stop: tuple[str, ...] = ()  # the tokens that end an answer
    tool_format: str | None = None  # template, harmony, generic or none
    reasoning: bool | None = None  # writes its reasoning apart
    fim_tokens: tuple[str, str, str] | None = None  # prefix, suffix, middle
    mistyped: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ChatFacts:
        f = _Fields(d)
        return cls(
            capabilities=f.texts("capabilities"),
            template=f.text("template"),
            stop=f.texts("stop") or (),
            tool_format=f.text("tool_format"),
            reasoning=f.flag("reasoning"),
            fim_tokens=_fim(f.take("fim_tokens", _is_fim)),
            mistyped=f.named(),
        )


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


_Doc = TypeVar("_Doc", PrefixCacheStatus, PrefixDiskStatus, ChatFacts)


def _nested(f: _Fields, key: str, read: Callable[[Mapping[str, Any]], _Doc]) -> _Doc | None:
    """A nested document by its reader: None when absent or not an object."""
    d = f.document(key)
    if d is None:
        return None
    doc = read(d)
    f.nested(key, doc.mistyped)
    return doc


@dataclass(frozen=True)
class AgentStatus:
    """The fields of an agent's /status the control plane reads."""

    backend: str | None = None  # "mlx" (decode), "torch" (prefill)
    device: str | None = None  # as the framework names it: "Device(gpu, 0)", "cuda"
    model: str | None = None  # the model directory on the agent's host
    loaded: bool | None = None  # its model is loaded
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
    # Time to first token over its recent requests (None: none yet).
    ttft_p50_s: float | int | None = None
    ttft_p95_s: float | int | None = None
    ttft_p99_s: float | int | None = None
    # A decode agent's BLAS on an mlx CPU (disagg_agents/runtime/fastblas.py):
    # "bundled" or "openblas (numpy): PATH", its threads now, and why fewer than
    # it started with (disagg_agents/runtime/blasshare.py; None: every thread).
    blas: str | None = None
    blas_threads: int | None = None
    blas_limited_by: str | None = None
    # The weights' fingerprint (architecture, dtype, layers, weights.quantization),
    # compared whole between agents; what the control plane shows of it is
    # `weights_format`.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    weights_format: WeightsFormat = field(default_factory=WeightsFormat)
    chat: ChatFacts | None = None  # None: the agent sent none (a prefill agent, an older release)
    prefix_cache: PrefixCacheStatus | None = None
    prefix_disk: PrefixDiskStatus | None = None  # a decode agent run with --prefix-disk
    last_error: dict[str, Any] | None = None  # the last request's error: at, message
    # A prefill agent's MoE layers, each with the GEMM path it takes (empty: dense).
    moe_paths: tuple[MoePath, ...] = ()
    mistyped: tuple[str, ...] = ()  # the fields sent with another type, nested ones dotted
    doc: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AgentStatus:
        """The /status object as sent; what is missing or mistyped reads as None."""
        f = _Fields(d)
        fingerprint = f.document("fingerprint") or {}
        return cls(
            backend=f.text("backend"),
            device=f.text("device"),
            model=f.text("model"),
            loaded=f.flag("loaded"),
            context=f.count("context"),
            in_flight=f.count("in_flight"),
            queued=f.count("queued"),
            batch=f.count("batch"),
            max_batch=f.count("max_batch"),
            requests=f.count("requests"),
            errors=f.count("errors"),
            cancelled=f.count("cancelled"),
            uptime_s=f.number("uptime_s"),
            rss_bytes=f.count("rss_bytes"),
            ttft_p50_s=f.number("ttft_p50_s"),
            ttft_p95_s=f.number("ttft_p95_s"),
            ttft_p99_s=f.number("ttft_p99_s"),
            blas=f.text("blas"),
            blas_threads=f.count("blas_threads"),
            blas_limited_by=f.text("blas_limited_by"),
            fingerprint=fingerprint,
            weights_format=WeightsFormat.from_fingerprint(fingerprint),
            chat=_nested(f, "chat", ChatFacts.from_json),
            prefix_cache=_nested(f, "prefix_cache", PrefixCacheStatus.from_json),
            prefix_disk=_nested(f, "prefix_disk", PrefixDiskStatus.from_json),
            last_error=f.document("last_error"),
            moe_paths=_moe_paths(f),
            mistyped=f.named(),  # last: every read above has noted its own
            doc=dict(d),
        )


# The names a string-key read of /status or its nested documents would use
# (tests/test_layout.py holds the control plane to reading them by attribute).
STATUS_FIELDS = frozenset(
    f.name
    for doc in (AgentStatus, PrefixCacheStatus, PrefixDiskStatus, ChatFacts)
    for f in fields(doc)
) - {"doc"}

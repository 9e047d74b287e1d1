"""A result's metrics, each field documented once.

The names are the wire's and the JSON's (`disagg generate --json`, the gateways'
`disagg_metrics`): the seed documents' names first, then what explains them.
Times are seconds, sizes bytes; None where a run did not have that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Metrics:
    # --- the seed documents' names: every result carries these ---------------------
    prefill_time: float | None = None  # prompt through the model (remote: on the prefill agent)
    decode_time: float | None = None  # first token to last
    total_time: float | None = None  # the client's wall time, request sent to result read
    ttft: float | None = None  # the client's time to the first token
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prefill_speed: float | None = None  # prompt tokens / prefill_time
    decode_speed: float | None = None  # (completion_tokens - 1) / decode_time
    kv_bytes: int | None = None  # K/V frames on the wire, headers included
    kv_transfer_time: float | None = None  # first K/V layer placed to last
    method: str | None = None  # disaggregated | local | local-fallback | decode-only
    prefill_server: str | None = None
    decode_server: str | None = None
    # --- how the request went ------------------------------------------------------
    finish_reason: str | None = None  # "stop" (EOS or a stop sequence) or "length"
    tpot: float | None = None  # decode_time per token after the first
    agent_ttft: float | None = None  # the decode agent's own time to the first token
    agent_total_time: float | None = None  # the decode agent's request, start to end
    weights: str | None = None  # "same", or "mixed" when the prefill side has other weights
    placement: str | None = None  # where the decode agent chose to prefill: local | remote
    placement_reason: str | None = None
    fallback_reason: str | None = None  # why a remote prefill fell back to a local one
    rerouted_from: list[str] | None = None  # decode agents that failed this request first
    # The router's pick of decode agent (disagg.serving.affinity): agent, affine agent,
    # hit_chars of its remembered prefix, busy (in flight per healthy agent), reason.
    route: dict[str, Any] | None = None
    cached_tokens: int | None = None  # prompt positions whose K/V came from a prefix cache
    prefill_cached_tokens: int | None = None  # ... of those, served by the prefill agent's cache
    grammar_ms: float | None = None  # compiling the output grammar, or finding it cached
    # --- the K/V stream (disaggregated runs) -----------------------------------------
    prefill_address: str | None = None  # the address the decode agent reached it on
    path_failures: list[str] | None = None  # faster addresses that did not answer first
    codec: int | None = None  # 0 raw, 1 zstd, 2 shuffle+zstd
    codec_reason: str | None = None  # why codec "auto" chose it
    codec_probe: dict[str, Any] | None = None  # other codecs timed on one layer
    kv_quant: str | None = None  # None lossless, "int8"
    kv_payload_bytes: int | None = None  # K/V blocks as sent (compressed or not)
    kv_raw_bytes: int | None = None  # K/V blocks expanded
    kv_encode_time: float | None = None  # prefill side: shuffle + compress
    kv_quant_time: float | None = None  # prefill side: int8 quantization
    kv_decode_time: float | None = None  # decode side: decompress + unshuffle (+ dequantize)
    kv_link_bytes: int | None = None  # large frames only, timed from header to payload
    kv_link_time: float | None = None
    kv_wait_time: float | None = None  # PREFILL sent to the first layer placed
    kv_fetch_time: float | None = None  # dial to PREFILL_DONE
    kv_first_layer_at: float | None = None  # wall clock (time.time) of the first layer placed
    prefill_last_layer_at: float | None = None  # wall clock of the prefill side's last layer
    # --- where the time went (the web view draws it; agents.decode.timeline) -----------
    # at: Unix time the decode agent took the request; then seconds after it, on the
    # decode agent's clock: prefill_start, prefill_end, kv_first, kv_last (K/V layers
    # arriving), first_token, joined (entered the decode batch), done.
    timeline: dict[str, float | None] | None = None
    queue_time: float | None = None  # waiting: for the prefill device, then a batch slot
    prefill_queue_time: float | None = None  # ... of it, on the prefill agent
    fallback_kind: str | None = None  # unreachable | timeout | stream | prefill_error
    # Fields an agent of a newer release sends that this one does not know: kept.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Metrics:
        known = _NAMES
        m = cls(**{k: v for k, v in d.items() if k in known})
        m.extra = {k: v for k, v in d.items() if k not in known}
        return m

    def to_dict(self) -> dict[str, Any]:
        """The JSON names: the seed's always, the rest where the run had them."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is not None or f.name in SEED_NAMES:
                out[f.name] = value
        return {**out, **self.extra}

    def __getitem__(self, name: str) -> Any:
        """A metric by its wire name; KeyError for a name no release sends."""
        if name in _NAMES:
            return getattr(self, name)
        return self.extra[name]

    def __contains__(self, name: object) -> bool:
        """Whether the run had this metric (a value other than None)."""
        return isinstance(name, str) and self.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        """A metric by its wire name (None counts as absent)."""
        value = getattr(self, name, None) if name in _NAMES else self.extra.get(name)
        return default if value is None else value


_NAMES = frozenset(f.name for f in fields(Metrics)) - {"extra"}
SEED_NAMES = (
    "prefill_time",
    "decode_time",
    "total_time",
    "ttft",
    "prompt_tokens",
    "completion_tokens",
    "prefill_speed",
    "decode_speed",
    "kv_bytes",
    "kv_transfer_time",
    "method",
    "prefill_server",
    "decode_server",
)


# What says where the fleet is and how it failed: agents' names and addresses,
# fallback reasons, reroutes. Gateways leave these out unless a keyed caller asks.
INTERNAL_NAMES = frozenset(
    {
        "prefill_server",
        "decode_server",
        "prefill_address",
        "path_failures",
        "fallback_reason",
        "rerouted_from",
        "placement_reason",
        "codec_reason",
        "codec_probe",
        "route",  # the router's pick names the decode agents
    }
)


def public_metrics(m: Metrics) -> dict[str, Any]:
    """`m.to_dict()` without the internals (seed names kept, as None) and without
    fields this release does not know (they could be internals too)."""
    out = {k: v for k, v in m.to_dict().items() if k in _NAMES and k not in INTERNAL_NAMES}
    return {**out, **{k: None for k in SEED_NAMES if k in INTERNAL_NAMES}}

"""A result's metrics as the control plane shows them. The type itself
(`Metrics`, each field documented once) is the wire's, shared with the decode
agent: `disagg_agents.wire.answer`."""

from __future__ import annotations

from typing import Any

from disagg_agents.wire.answer import NAMES, SEED_NAMES, Metrics

# What says where the fleet is and how it failed: agents' names and addresses,
# fallback reasons, reroutes. Gateways leave these out unless the operator's key asks.
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
        "prefill_threads",
        "route",  # the router's pick names the decode agents
    }
)


def public_metrics(m: Metrics) -> dict[str, Any]:
    """`m.to_json()` without the internals (seed names kept, as None) and without
    fields this release does not know (they could be internals too)."""
    out = {k: v for k, v in m.to_json().items() if k in NAMES and k not in INTERNAL_NAMES}
    return {**out, **{k: None for k in SEED_NAMES if k in INTERNAL_NAMES}}


__all__ = ["INTERNAL_NAMES", "SEED_NAMES", "Metrics", "public_metrics"]

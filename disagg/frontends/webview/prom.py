"""The gateway's Prometheus metrics, from every result it hands out.

Agents' own /metrics sit behind the cluster token's challenge-response, which
Prometheus cannot answer; the gateway sees every request's full metrics, so it
is the one scrape target: `GET /metrics` on `disagg serve`'s port (with
`--api-key`: Prometheus' `authorization: {credentials: KEY}`). Names are listed
in METRICS; docs/grafana/disagg.json charts them.
"""

from __future__ import annotations

import threading
from collections import Counter

from disagg_agents.runtime.metrics import Histogram
from disagg_agents.wire.answer import Metrics

P = "disagg_gateway"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BYTES = tuple(float(1 << s) for s in range(10, 34, 2))  # 1 KiB .. 8 GiB, x4 apart
# Why a decode agent prefilled locally: disagg_agents.decode.kvfetch.FALLBACK_KINDS
# (a test holds them equal).
FALLBACK_KINDS = ("unreachable", "timeout", "stream", "prefill_error")
# How a request ended, in every place that says it: the APIs' finish reasons, these
# counters, the web view, the agents' own counters.
OUTCOMES = ("stop", "length", "tool_calls", "cancelled", "error")

# name -> (result metric it observes, buckets, help)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...], str]] = {
    "ttft_seconds": ("ttft", SECONDS, "Time to first token, seen by the gateway."),
    "tpot_seconds": ("tpot", SECONDS, "Time per output token after the first."),
    "prefill_seconds": ("prefill_time", SECONDS, "Prompt prefill compute."),
    "queue_seconds": ("queue_time", SECONDS, "Waiting: for the prefill device, a batch slot."),
    "kv_transfer_seconds": ("kv_transfer_time", SECONDS, "First to last K/V layer arriving."),
    "kv_bytes": ("kv_bytes", BYTES, "K/V bytes on the wire per disaggregated request."),
}
COUNTERS = {
    "requests_total": "Requests by model, method and outcome (stop, length, tool_calls, "
    "cancelled, error).",
    "fallbacks_total": "Requests prefilled on the decode agent because the prefill agent failed.",
    "prefix_hits_total": "Requests whose prompt reused K/V from a prefix cache.",
    "cached_tokens_total": "Prompt tokens whose K/V came from a prefix cache.",
    "disk_cached_tokens_total": "Of those, tokens read back from a decode agent's disk tier.",
    "prompt_tokens_total": "Prompt tokens of finished requests.",
    "completion_tokens_total": "Generated tokens of finished requests.",
}
IN_FLIGHT_HELP = "Requests running now."
AGENT_UP_HELP = "1 when the agent's /status answers, else 0 (polled while someone looks)."
GAUGES = {"in_flight": IN_FLIGHT_HELP, "agent_up": AGENT_UP_HELP}
METRICS = [f"{P}_{n}" for n in (*HISTOGRAMS, *COUNTERS, *GAUGES)]
# Series that measure prompts (tokens, K/V bytes, cache hits): summed over tenants,
# a quiet moment's delta is another tenant's request exactly. The operator's only.
OPERATOR_ONLY = (
    "kv_bytes",
    "prefix_hits_total",
    "cached_tokens_total",
    "disk_cached_tokens_total",
    "prompt_tokens_total",
    "completion_tokens_total",
)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    esc = (
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in pairs
    )
    return "{" + ",".join(esc) + "}"


class GatewayMetrics:
    """Counters and histograms labelled by model; every series exists from the
    start (at zero), so dashboards and alerts see the names before traffic."""

    def __init__(self, models: list[str]) -> None:
        self.lock = threading.Lock()
        self.hists: dict[tuple[str, str], Histogram] = {}
        self.counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        self.in_flight: Counter[str] = Counter()
        self.agents_up: dict[tuple[str, str, str], int] = {}
        for m in models:
            for name, (_, buckets, _) in HISTOGRAMS.items():
                self.hists[(name, m)] = Histogram(buckets)
            for reason in FALLBACK_KINDS:
                self.counts[("fallbacks_total", (("model", m), ("reason", reason)))] += 0
            for name in COUNTERS:
                if name not in ("requests_total", "fallbacks_total"):
                    self.counts[(name, (("model", m),))] += 0
            self.in_flight[m] += 0

    def begin(self, model: str) -> None:
        with self.lock:
            self.in_flight[model] += 1

    def end(self, model: str, metrics: Metrics | None, outcome: str) -> None:
        """A request ended: `outcome` is one of OUTCOMES; `metrics` what it measured
        (a cancelled or stop-ended request's too)."""
        m = metrics or Metrics()
        method = str(m.method or "none")
        ok = outcome != "error" and metrics is not None
        with self.lock:
            self.in_flight[model] -= 1
            self.counts[
                ("requests_total", (("model", model), ("method", method), ("outcome", outcome)))
            ] += 1
            if not ok:
                return
            for name, (key, buckets, _) in HISTOGRAMS.items():
                value = getattr(m, key)
                if name.startswith("kv_") and method != "disaggregated":
                    continue  # nothing crossed the wire
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.hists.setdefault((name, model), Histogram(buckets)).observe(float(value))
            if m.method == "local-fallback":
                reason = str(m.fallback_kind or "stream")
                self.counts[("fallbacks_total", (("model", model), ("reason", reason)))] += 1
            cached = int(m.cached_tokens or 0)
            self.counts[("prefix_hits_total", (("model", model),))] += cached > 0
            self.counts[("cached_tokens_total", (("model", model),))] += cached
            disk = min(cached, int(m.disk_cached_tokens or 0))
            self.counts[("disk_cached_tokens_total", (("model", model),))] += disk
            for name, count in (
                ("prompt_tokens_total", m.prompt_tokens),
                ("completion_tokens_total", m.completion_tokens),
            ):
                self.counts[(name, (("model", model),))] += int(count or 0)

    def agent(self, name: str, role: str, model: str, up: bool) -> None:
        with self.lock:
            self.agents_up[(name, role, model)] = int(up)

    def text(self, fleet: bool = True) -> str:
        """Prometheus text exposition format 0.0.4; `fleet` False (a tenant) leaves
        out the agents (their names are the operator's to see) and OPERATOR_ONLY.
        No series carries prompt text or a tenant: counts are summed over tenants."""
        out: list[str] = []
        with self.lock:
            for name, (_, _, help_) in HISTOGRAMS.items():
                if not fleet and name in OPERATOR_ONLY:
                    continue
                out += [f"# HELP {P}_{name} {help_}", f"# TYPE {P}_{name} histogram"]
                for (n, model), h in sorted(self.hists.items()):
                    if n != name:
                        continue
                    lab = (("model", model),)
                    for edge, c in zip(h.buckets, h.counts, strict=True):
                        out.append(
                            f"{P}_{name}_bucket{_labels((*lab, ('le', f'{edge:.12g}')))} {c}"
                        )
                    out.append(f"{P}_{name}_bucket{_labels((*lab, ('le', '+Inf')))} {h.total}")
                    out.append(f"{P}_{name}_sum{_labels(lab)} {h.sum}")
                    out.append(f"{P}_{name}_count{_labels(lab)} {h.total}")
            for name, help_ in COUNTERS.items():
                if not fleet and name in OPERATOR_ONLY:
                    continue
                out += [f"# HELP {P}_{name} {help_}", f"# TYPE {P}_{name} counter"]
                for (n, pairs), v in sorted(self.counts.items()):
                    if n == name:
                        out.append(f"{P}_{name}{_labels(pairs)} {v}")
            out += [f"# HELP {P}_in_flight {IN_FLIGHT_HELP}", f"# TYPE {P}_in_flight gauge"]
            out += [
                f"{P}_in_flight{_labels((('model', m),))} {v}"
                for m, v in sorted(self.in_flight.items())
            ]
            if not fleet:
                return "\n".join(out) + "\n"
            out += [f"# HELP {P}_agent_up {AGENT_UP_HELP}", f"# TYPE {P}_agent_up gauge"]
            out += [
                f"{P}_agent_up{_labels((('agent', a), ('role', r), ('model', m)))} {v}"
                for (a, r, m), v in sorted(self.agents_up.items())
            ]
        return "\n".join(out) + "\n"

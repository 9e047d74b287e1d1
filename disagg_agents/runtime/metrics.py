"""Request counters and latency histograms of one agent: JSON for /status,
Prometheus text for /metrics. Stdlib only."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BUCKETS_BYTES = tuple(float(1 << s) for s in range(10, 34, 2))  # 1 KiB .. 8 GiB, x4 apart
WINDOW = 1000  # recent TTFTs kept for percentiles
EMA_ALPHA = 0.3  # weight of the newest observation in the agents' moving averages


def ema(old: float | None, new: float) -> float:
    """An exponential moving average's next value (the first observation as is)."""
    return new if old is None else (1 - EMA_ALPHA) * old + EMA_ALPHA * new


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [
            f'{name}_bucket{{le="{edge:.12g}"}} {n}'
            for edge, n in zip(self.buckets, self.counts, strict=True)
        ]
        out += [
            f'{name}_bucket{{le="+Inf"}} {self.total}',
            f"{name}_sum {self.sum}",
            f"{name}_count {self.total}",
        ]
        return out


class LastError(logging.Handler):
    """Keeps the agent's last ERROR line (time and message) for /status, so a
    dashboard can mark an agent that is up but failing."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last: dict[str, Any] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            text += f": {type(e).__name__}: {e}"
        self.last = {"at": record.created, "message": text[:500]}


# installed on the root logger by disagg_agents.runtime.logs.setup_logging
LAST_ERROR = LastError()


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux), else its peak (macOS: bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


# Outcomes that are no failure: a request answered (ok; a finish reason) or left by its client.
FINE = frozenset({"ok", "stop", "length", "tool_calls", "cancelled"})


class Stats:
    """Updated from request threads; read by the control endpoint."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.started = time.time()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (method, outcome)
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.transfer = Histogram()
        self.prefill = Histogram()
        self.queue = Histogram()  # waiting: for the prefill device, for a batch slot
        self.kv_request = Histogram(BUCKETS_BYTES)  # K/V bytes per request that moved any
        self.fallbacks: Counter[str] = Counter()  # by disagg_agents.decode.kvfetch.FALLBACK_KINDS
        self.kv_bytes = 0
        self.completion_tokens = 0  # tokens this agent generated (a migrated stream: its part)
        self.recent_ttft: list[float] = []
        # More Prometheus text from the agent's other parts (e.g. its prefix cache).
        self.extra: list[Callable[[], str]] = []

    def begin(self) -> None:
        with self.lock:
            self.in_flight += 1

    def end(self, outcome: str, metrics: dict[str, Any] | None = None) -> None:
        """`outcome`: how the request ended, the gateway's words where they apply: a
        finish reason (stop, length, tool_calls), cancelled (the client left), error;
        also ok (a prefill sent), bad_request, peer_stalled. `metrics`: the request's."""
        m = metrics or {}
        with self.lock:
            self.in_flight -= 1
            self.outcomes[(str(m.get("method") or self.role), outcome)] += 1
            if m.get("ttft") is not None:
                self.ttft.observe(m["ttft"])
                self.recent_ttft = (self.recent_ttft + [m["ttft"]])[-WINDOW:]
            if m.get("tpot") is not None:
                self.tpot.observe(m["tpot"])
            if self.role == "prefill" and m.get("prefill_time") is not None:
                self.prefill.observe(m["prefill_time"])
            if m.get("kv_transfer_time"):
                self.transfer.observe(m["kv_transfer_time"])
            if m.get("queue_time") is not None:
                self.queue.observe(m["queue_time"])
            if m.get("kv_bytes"):
                self.kv_request.observe(m["kv_bytes"])
            if m.get("fallback_kind"):
                self.fallbacks[str(m["fallback_kind"])] += 1
            self.kv_bytes += int(m.get("kv_bytes") or 0)
            self.completion_tokens += int(m.get("completion_tokens") or 0)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            recent = list(self.recent_ttft)
            total = sum(self.outcomes.values())
            errors = sum(n for (_, o), n in self.outcomes.items() if o not in FINE)
            cancelled = sum(n for (_, o), n in self.outcomes.items() if o == "cancelled")
            in_flight = self.in_flight
            generated = self.completion_tokens
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "requests": total + in_flight,
            "errors": errors,
            "cancelled": cancelled,
            "in_flight": in_flight,
            "completion_tokens": generated,
            "ttft_p50_s": percentile(recent, 0.50),
            "ttft_p95_s": percentile(recent, 0.95),
            "ttft_p99_s": percentile(recent, 0.99),
            "rss_bytes": rss_bytes(),
            "last_error": LAST_ERROR.last,
        }

    def prometheus(self) -> str:
        p = "disagg"
        with self.lock:
            lines = [f"# TYPE {p}_requests_total counter"]
            lines += [
                f'{p}_requests_total{{role="{self.role}",method="{m}",outcome="{o}"}} {n}'
                for (m, o), n in sorted(self.outcomes.items())
            ]
            lines += [
                f"# TYPE {p}_in_flight gauge",
                f"{p}_in_flight {self.in_flight}",
                f"# TYPE {p}_kv_bytes_total counter",
                f"{p}_kv_bytes_total {self.kv_bytes}",
                f"# TYPE {p}_uptime_seconds gauge",
                f"{p}_uptime_seconds {time.time() - self.started:.3f}",
            ]
            lines.append(f"# TYPE {p}_fallbacks_total counter")
            lines += [
                f'{p}_fallbacks_total{{role="{self.role}",reason="{r}"}} {n}'
                for r, n in sorted(self.fallbacks.items())
            ]
            for name, hist in (
                ("ttft_seconds", self.ttft),
                ("tpot_seconds", self.tpot),
                ("kv_transfer_seconds", self.transfer),
                ("prefill_seconds", self.prefill),
                ("queue_seconds", self.queue),
                ("kv_request_bytes", self.kv_request),
            ):
                lines += [f"# TYPE {p}_{name} histogram", *hist.lines(f"{p}_{name}")]
        return "\n".join(lines) + "\n" + "".join(fn() for fn in self.extra)

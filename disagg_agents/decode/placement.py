"""Where to prefill a prompt: on the prefill agent, or here on the decode host.

Judged from rates this agent measured on earlier requests, never from a fixed
constant: remote = handshake + tokens / remote rate + the last layer's transfer
(the other layers hide behind compute), counting only the tokens past a prefix
this agent holds from that prefill agent (only the suffix is sent, and its own
cache normally holds the prefix it made); local = tokens / local prefill rate, or
tokens x one decode step when no local prefill was measured yet (an upper bound:
a prefill step batches tokens, a decode step does not).

A local rate holds for prompts near the lengths it was measured at: attention's
cost grows with the square of the length, and more steeply on some backends than
others (mlx on a Linux CPU: 45,600 tokens of a tiny model took 150 s here, torch
8 s, where short prompts had measured the two alike). A prompt over EXTRAPOLATE x
the longest one prefilled here goes remote, as the prefill agent exists to take
long prompts; a forced local prefill that long measures it.

A remote estimate is only renewed by a remote prefill, so one taken while the
prefill agent was slowed (a burst of other work, a link's bad minute) would keep
every prompt local for good: a local choice against a remote rate older than
REMEASURE_S goes remote once instead, and measures it again.

Nor can one burst teach it: time a prompt waited in the prefill agent's queue is
not the link's handshake (a burst of 14 long prompts once taught "53,939 ms
handshake", and every tenant's prompts then went local for good). So a handshake
sample is the fetch less the compute and the queue wait, and at most
HANDSHAKE_MAX_S; the queue wait is kept apart, at most QUEUE_MAX_S, halving every
QUEUE_HALF_LIFE_S, and none at all once the prefill agent says nobody waits
behind the prompt it just sent: remote again as soon as that agent is idle.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from disagg_agents.models.cost import Prior
from disagg_agents.runtime.metrics import ema

REMEASURE_S = 60.0  # a prefill agent's rates older than this are measured again
EXTRAPOLATE = 4  # a local rate stands for prompts up to this many times the longest measured
HANDSHAKE_MAX_S = 2.0  # a longer "handshake" was a wait somewhere, not the link
QUEUE_MAX_S = 30.0  # a queue-wait sample counts at most this
QUEUE_HALF_LIFE_S = 5.0  # a measured queue wait halves every this many seconds


def clamp(x: float, low: float, high: float) -> float:
    return min(high, max(low, x))


@dataclass
class RemoteRates:
    handshake_s: float | None = None
    tokens_per_s: float | None = None
    bytes_per_s: float | None = None
    layer_bytes_per_token: float | None = None
    measured_at: float | None = None  # time.monotonic() of the last remote prefill
    queue_s: float = 0.0  # the last prompt's wait in that agent's queue (bounded)

    def queue_now(self, now: float) -> float:
        """The queue wait to expect now: the last one, halved every QUEUE_HALF_LIFE_S."""
        if not self.queue_s or self.measured_at is None:
            return 0.0
        age = max(0.0, now - self.measured_at)
        return float(self.queue_s * 0.5 ** (age / QUEUE_HALF_LIFE_S))


class Placement:
    """`prior` (disagg_agents.models.cost): rates guessed from published device figures,
    used for what has not been measured yet; without it, remote until measured."""

    def __init__(self, prior: Prior | None = None) -> None:
        self.prior = prior
        self.lock = threading.Lock()
        self.local_tokens_per_s: float | None = None
        self.local_longest = 0  # the longest prompt prefilled here (tokens)
        self.step_s: float | None = None
        self.remote: dict[str, RemoteRates] = {}

    def observe_local(self, tokens: int, seconds: float) -> None:
        if tokens > 1 and seconds > 0:
            with self.lock:
                self.local_tokens_per_s = ema(self.local_tokens_per_s, tokens / seconds)
                self.local_longest = max(self.local_longest, tokens)

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            with self.lock:
                self.step_s = ema(self.step_s, seconds)

    def observe_remote(self, key: str, tokens: int, layers: int, m: dict[str, Any]) -> None:
        """`m`: the metrics of one KV fetch (prefill_time, kv_fetch_time, kv_bytes,
        prefill_queue_time, and prefill_queue_waiting: how many waited behind it)."""
        prefill_s, fetch_s = m.get("prefill_time"), m.get("kv_fetch_time")
        if not prefill_s or not fetch_s or tokens <= 0:
            return
        queued_s = max(0.0, float(m.get("prefill_queue_time") or 0.0))
        handshake = clamp(fetch_s - prefill_s - queued_s, 0.0, HANDSHAKE_MAX_S)
        with self.lock:
            r = self.remote.setdefault(key, RemoteRates())
            r.tokens_per_s = ema(r.tokens_per_s, tokens / prefill_s)
            r.handshake_s = ema(r.handshake_s, handshake)
            # Nobody waits behind it: the next prompt starts at once.
            idle = m.get("prefill_queue_waiting") == 0
            r.queue_s = 0.0 if idle else min(queued_s, QUEUE_MAX_S)
            r.layer_bytes_per_token = m["kv_bytes"] / layers / tokens
            r.measured_at = time.monotonic()
            if m.get("kv_transfer_time"):
                r.bytes_per_s = ema(r.bytes_per_s, m["kv_bytes"] / m["kv_transfer_time"])

    def choose(self, key: str, tokens: int, cached: int = 0) -> tuple[str, str]:
        """("remote" | "local", why) for a prompt of `tokens` to prefill, of which
        `cached` (a prefix hit on K/V that prefill agent made) need no remote work."""
        with self.lock:
            r = self.remote.get(key)
            local_rate, step = self.local_tokens_per_s, self.step_s
            longest = self.local_longest
            queue = r.queue_now(time.monotonic()) if r is not None else 0.0
        p, guessed = self.prior, []
        if r is None or r.tokens_per_s is None or r.handshake_s is None:
            if p is None:
                return "remote", "no measurement of the prefill agent yet"
            r = RemoteRates(
                p.handshake_s, p.remote_tokens_per_s, p.link_bytes_per_s, p.layer_bytes_per_token
            )
            guessed.append("remote")
        assert r.tokens_per_s is not None and r.handshake_s is not None
        if local_rate is None and step is None and p is not None:
            local_rate = p.local_tokens_per_s
            guessed.append("local")
        sent = max(1, tokens - cached)  # only the suffix is computed and sent
        remote = r.handshake_s + queue + sent / r.tokens_per_s
        if r.bytes_per_s and r.layer_bytes_per_token:
            remote += sent * r.layer_bytes_per_token / r.bytes_per_s
        if local_rate is not None:
            local, basis = tokens / local_rate, f"local prefill {local_rate:,.0f} tok/s"
        elif step is not None:
            local, basis = tokens * step, f"{tokens} decode steps of {step * 1e3:.1f} ms"
        else:
            return "remote", "no measurement of local prefill yet"
        why = (
            f"est. remote {remote * 1e3:.1f} ms (prefill {r.tokens_per_s:,.0f} tok/s + "
            f"{r.handshake_s * 1e3:.1f} ms handshake"
            + (f" + {queue * 1e3:.1f} ms queue" if queue else "")
            + f") vs local {local * 1e3:.1f} ms ({basis})"
        )
        if cached:
            why += f"; {cached} of {tokens} tokens cached from that prefill agent"
        if guessed:
            why += f"; {' and '.join(guessed)} rate from the prior, not measured"
        if local >= remote:
            return "remote", why
        if longest and tokens > EXTRAPOLATE * longest:
            return "remote", (
                f"{why}; {tokens} tokens is past {EXTRAPOLATE}x the longest prompt "
                f"prefilled here ({longest}): its local rate is not known"
            )
        age = None if r.measured_at is None else time.monotonic() - r.measured_at
        if age is not None and age > REMEASURE_S:
            with self.lock:
                r.measured_at = time.monotonic()  # one request re-measures, not every one
            return "remote", f"{why}; measuring the prefill agent again ({age:.0f} s old)"
        return "local", why

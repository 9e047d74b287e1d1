"""Every request the gateway runs, while it runs and for a while after: what the
web view lists and draws, and what the gateway's /metrics counts.

It wraps the router's `run` (the one door every gateway request goes through),
so the request path itself knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from disagg.frontends import tenancy
from disagg.frontends.webview.prom import GatewayMetrics
from disagg.serving.router import StopGeneration
from disagg.serving.verdict import header_value, verdict
from disagg_agents.wire.answer import Metrics, TokenEvent
from disagg_agents.wire.text import printable

access = logging.getLogger("disagg.requests")  # `disagg serve` shows it on stderr
KEEP = 300  # finished requests kept for the view's list and charts
# Requests refused before they ran (401s, 404s, bad bodies), kept apart: 300 GETs
# without a key once pushed every real request out of the view's history.
REFUSED_KEEP = 50
PROMPT_CHARS = 120  # of a prompt shown in the list
# What agent CLIs wrap around the user's words (Claude Code's reminders): not the words.
# The ids of requests that began (and so are listed) inside the HTTP request running
# here: a 4xx that one of them ended with is not listed a second time as a refusal.
_begun_here: ContextVar[list[int] | None] = ContextVar("disagg_begun_here", default=None)


def watch_begun() -> list[int]:
    """From here on in this context, `RequestLog.begin` notes its ids in the list."""
    begun: list[int] = []
    _begun_here.set(begun)
    return begun


WRAPPERS = re.compile(r"<system-reminder>.*?(</system-reminder>|$)", re.S)


def prompt_of(request: Any) -> str:
    """The text a person recognises the request by (a GenerateRequest, or its dict):
    the prompt, or the last user message."""
    get = request.get if isinstance(request, dict) else lambda k: getattr(request, k, None)
    text = get("prompt")
    if text is None:
        users = [m for m in get("messages") or [] if m.get("role") == "user"]
        text = users[-1].get("content") if users else ""
    if isinstance(text, list):  # content parts: their text
        text = " ".join(str(p.get("text") or "") for p in text if isinstance(p, dict))
    text = " ".join(WRAPPERS.sub(" ", str(text or "")).split())
    return text if len(text) <= PROMPT_CHARS else text[: PROMPT_CHARS - 1] + "…"


def access_line(t: Tracked) -> str:
    """One line per request, no prompt text: `disagg serve` logs it."""
    m = t.metrics or Metrics()

    def secs(v: Any) -> str:
        return f"{v:.3f}s" if isinstance(v, int | float) else "-"

    line = (
        f"request {t.id} {t.model} {t.outcome} {m.method or '-'}: "
        f"{m.prompt_tokens or 0} prompt ({m.cached_tokens or 0} cached) + "
        f"{int(m.completion_tokens or t.tokens)} tokens, ttft {secs(m.ttft)}, "
        f"{secs(t.ended_s)} in all"
    )
    if m.method:
        line += f" [{header_value(m)}]"  # the answer's verdict header
    return line + (f"; {printable(t.error, 200)}" if t.error else "")  # ESC from a schema


def why(m: Metrics) -> str | None:
    """Why the request was served the way it was, in one line."""
    if m.method == "local-fallback":
        return m.fallback_reason
    if m.method == "local":
        return m.placement_reason
    return None


@dataclass
class Tracked:
    id: int
    model: str
    prompt: str
    started: float  # Unix time
    t0: float = field(default_factory=time.monotonic)
    tokens: int = 0
    first_token_s: float | None = None
    ended_s: float | None = None
    error: str | None = None
    outcome: str | None = None  # once ended: one of prom.OUTCOMES
    # The prompt's side while it decodes (the first token's), then the whole answer's.
    # None: nothing measured (yet, or ever: it failed).
    metrics: Metrics | None = None
    tenant: bytes | None = None  # whose request: its key's digest (tenancy)
    reason: str | None = None  # a refused request's error message, as its client got it

    def view(self, now: float, fleet: bool = True) -> dict[str, Any]:
        """The list's row; without `fleet` (a tenant's own view) no agent names
        and no reasons (which may name agents or addresses)."""
        m = self.metrics or Metrics()
        state = "running" if self.ended_s is None else ("failed" if self.error else "done")
        if self.outcome == "refused":
            state = "refused"
        row = {
            "id": self.id,
            "model": self.model,
            "prompt": self.prompt,
            "started": self.started,
            "state": state,
            "outcome": self.outcome,
            "elapsed": round((self.ended_s if self.ended_s is not None else now - self.t0), 4),
            "tokens": int(m.completion_tokens or self.tokens),
            "first_token": self.first_token_s,
            "error": self.error,
            "method": m.method,
            "why": why(m),
            "prefill_server": m.prefill_server,
            "decode_server": m.decode_server,
            "ttft": m.ttft,
            "tpot": m.tpot,
            "kv_bytes": m.kv_bytes,
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "timeline": m.timeline.as_json() if m.timeline is not None else None,
            "queue_time": m.queue_time,
            "verdict": verdict(m) if m.method else None,
        }
        if fleet:
            row["tenant"] = tenancy.label(self.tenant)
        else:
            error = tenancy.for_tenant(self.error) if self.error else None
            row.update(why=None, prefill_server=None, decode_server=None, error=error)
        if self.outcome == "refused":  # the client's own error message, addresses hidden
            reason = self.reason
            row["why"] = reason if fleet or not reason else tenancy.for_tenant(reason)
        return row


class RequestLog:
    """In-flight and recent requests; thread-safe (requests run on worker threads)."""

    def __init__(self, models: list[str]) -> None:
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.running: dict[int, Tracked] = {}
        self.done: deque[Tracked] = deque(maxlen=KEEP)
        self.refusals: deque[Tracked] = deque(maxlen=REFUSED_KEEP)
        self.metrics = GatewayMetrics(models)

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """`run` (Router.run's signature) that records each request it serves."""

        @functools.wraps(run)
        def tracked(
            model: str | None,
            request: Any,
            on_token: Callable[[TokenEvent], None] | None = None,
            **kw: Any,
        ) -> Any:
            t = self.begin(str(model or "?"), request)

            def seen(tok: TokenEvent) -> None:
                if tok.id is not None:
                    t.tokens += 1
                    if t.first_token_s is None:
                        t.first_token_s = round(time.monotonic() - t.t0, 4)
                        # The prompt's side while it decodes; its timeline (at,
                        # first_token) is no answer's: the view draws finished ones.
                        if tok.metrics is not None:
                            t.metrics = dataclasses.replace(tok.metrics, timeline=None)
                if on_token is not None:
                    on_token(tok)

            try:
                result = run(model, request, on_token=seen, **kw)
            except BaseException as e:
                # A stop sequence or a caller that left ends a request early on
                # purpose (StopGeneration): no failure, and it measured what it did.
                if isinstance(e, StopGeneration):
                    self.end(t, e.metrics or Metrics(), None, e.reason)
                else:
                    self.end(t, None, str(e) or type(e).__name__, "error")
                raise
            m = result.metrics
            self.end(t, m, None, str(m.finish_reason or "stop"))
            return result

        return tracked

    def refused(self, method: str, path: str, status: int, reason: str | None = None) -> None:
        """A request answered with an error before it ran (a 404, a 401, a bad body):
        listed in the view with the error's message, not counted as a request."""
        what = printable(f"{method} {path}", PROMPT_CHARS)
        t = Tracked(next(self.ids), "", what, time.time(), error=f"HTTP {status}")
        t.reason = printable(reason, 300) if reason else None
        t.ended_s, t.outcome = 0.0, "refused"
        with self.lock:
            self.refusals.append(t)

    def begin(self, model: str, request: Any) -> Tracked:
        t = Tracked(next(self.ids), model, prompt_of(request), time.time())
        t.tenant = tenancy.current()
        begun = _begun_here.get()
        if begun is not None:
            begun.append(t.id)
        with self.lock:
            self.running[t.id] = t
        self.metrics.begin(model)
        return t

    def end(
        self,
        t: Tracked,
        metrics: Metrics | None,
        error: str | None,
        outcome: str | None = None,
    ) -> None:
        if outcome is None:  # one of prom.OUTCOMES, from what it ended with
            outcome = "error" if error else str((metrics and metrics.finish_reason) or "stop")
        t.metrics = metrics
        t.error, t.outcome = error, outcome
        t.ended_s = round(time.monotonic() - t.t0, 4)
        with self.lock:
            self.running.pop(t.id, None)
            self.done.append(t)
        self.metrics.end(t.model, metrics, outcome)
        access.info("%s", access_line(t))

    def snapshot(self, tenant: bytes | None = None, everyone: bool = True) -> list[dict[str, Any]]:
        """Newest first: running ones, then finished ones; every tenant's for the
        operator (`everyone`), else `tenant`'s own only, without the fleet's names."""
        now = time.monotonic()
        with self.lock:
            ended = sorted([*self.done, *self.refusals], key=lambda t: t.id, reverse=True)
            items = list(self.running.values())[::-1] + ended
        if not everyone:
            items = [t for t in items if t.tenant is not None and t.tenant == tenant]
        return [t.view(now, fleet=everyone) for t in items]

    def finished_since(self, seconds: float) -> list[Metrics]:
        """Metrics of requests that ended in the last `seconds`."""
        cutoff = time.monotonic() - seconds
        with self.lock:
            return [
                t.metrics
                for t in self.done
                if t.ended_s is not None and t.t0 + t.ended_s >= cutoff and t.metrics is not None
            ]

"""Routing and failover: pick a healthy decode agent of a pipeline (the one
holding the request's prefix unless it is too busy, disagg.serving.affinity; else
the least busy), hand it the pipeline's prefill agent, and reroute when a decode
agent dies.

Prefill failover lives in the decode agent itself (it prefills locally when the
prefill agent is down, slow, or drops the KV stream); the slower data path is the
next address in the prefill target's `hosts`.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from disagg.errors import (
    AgentError,
    AuthError,
    ConnectError,
    ModelMismatch,
    RequestTimeout,
    UsageError,
)
from disagg.serving import affinity, wireclient
from disagg.serving.completion import Completion
from disagg.serving.metrics import Metrics
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest, PrefillTarget

DOWN_FOR_S = 5.0  # a failed agent is skipped this long before it is probed again
HEALTH_TTL_S = 2.0
# A probe that times out within this long of the agent's last "ok" finds it busy, not
# dead: on a loaded box /health can take over a second, and a healthy agent marked
# down loses its chats' prefix affinity. A hung agent is failed over by the decode
# idle deadline (which marks it down and forgets this grace), or after the grace.
SLOW_GRACE_S = 30.0


@dataclass
class Endpoint:
    name: str
    host: str  # where the control plane reaches its data port
    port: int
    control_port: int | None = None
    hosts: list[str] = field(default_factory=list)  # data-plane addresses, fastest first

    def prefill_target(
        self, timeout_s: float | None = None, integrity: str = "mac"
    ) -> PrefillTarget:
        """This prefill agent as a request's prefill target: the one place it is built."""
        return PrefillTarget(self.hosts or [self.host], self.port, timeout_s, self.name, integrity)


@dataclass
class Route:
    """A model's agents as the router sees them (built from an inventory pipeline,
    or from local agents): where to send its requests, and how long to wait."""

    name: str
    prefill: list[Endpoint]
    decode: list[Endpoint]
    prefill_timeout_s: float = 60.0
    # An idle deadline: a decode agent that sends no frame (token or PROGRESS) for
    # this long failed. A stream that keeps producing tokens runs as long as it needs.
    decode_timeout_s: float = 180.0
    integrity: str = "mac"  # frames between its agents: see disagg_agents.wire.INTEGRITY
    # Times one request may move to another decode agent mid-answer (migration).
    max_migrations: int = 2
    # An embedding model with prefill agents only: chat and generate are refused.
    embedding_only: bool = False


def _timed_out(e: BaseException) -> bool:
    """urllib raises a timeout bare while reading, wrapped in URLError while connecting."""
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


class StopGeneration(Exception):
    """Raised from a token callback to end a request early: a stop sequence matched
    (`reason` "stop") or its caller left ("cancelled"). The router sets `metrics`:
    what is known of the request when it ended (`cut_short`)."""

    def __init__(self, reason: str = "stop") -> None:
        super().__init__(reason)
        self.reason = reason
        self.metrics: Metrics | None = None


def cut_short(
    early: Metrics | None, t_sent: float, t_first: float | None, tokens: int, reason: str
) -> Metrics:
    """A request's metrics when its client stopped reading before the agent's DONE:
    the prompt's side from the first TOKEN frame (`early`, disagg_agents.decode.tokenframes'
    first_metrics), the decode side timed here."""
    now = time.perf_counter()
    m = Metrics.from_json(early.to_json()) if early is not None else Metrics()  # a copy
    timeline, m.timeline = m.timeline, None
    m.agent_ttft, m.ttft = m.ttft, None if t_first is None else t_first - t_sent
    m.completion_tokens, m.finish_reason, m.total_time = tokens, reason, now - t_sent
    if t_first is not None:
        m.decode_time = now - t_first
        if tokens > 1 and m.decode_time > 0:
            m.tpot, m.decode_speed = m.decode_time / (tokens - 1), (tokens - 1) / m.decode_time
    if isinstance(m.prefill_time, int | float) and m.prefill_time > 0 and m.prompt_tokens:
        m.prefill_speed = m.prompt_tokens / m.prefill_time
    if timeline is not None and timeline.at is not None and timeline.first_token is not None:
        done = timeline.first_token + (m.decode_time or 0.0)
        m.timeline = replace(timeline, done=done)
    return m


class Relay:
    """One decode agent's try at a request, as its token callback: it passes every
    event on (a migrated try sends only what comes after the tokens it was given),
    keeps the answer's token ids for the next try, notes its first token's time and
    metrics, and stops at Router.cut_all."""

    def __init__(
        self,
        delivered: list[TokenEvent],
        on_token: Callable[[TokenEvent], None] | None,
        cutting: threading.Event,
    ) -> None:
        self.delivered, self.on_token, self.cutting = delivered, on_token, cutting
        self.t_sent = time.perf_counter()
        self.t_first: float | None = None
        self.early: Metrics | None = None  # the first TOKEN's (disagg_agents.decode first_metrics)

    def cut(self, reason: str) -> Metrics:
        """The metrics of a request ended early (cut_short), as far as it went."""
        tokens = sum(t.id is not None for t in self.delivered)
        return cut_short(self.early, self.t_sent, self.t_first, tokens, reason)

    def __call__(self, tok: TokenEvent) -> None:
        if self.cutting.is_set():
            raise StopGeneration("cancelled")
        if self.t_first is None and tok.id is not None:
            self.t_first, self.early = time.perf_counter(), tok.metrics
        self.delivered.append(tok)
        if self.on_token:
            self.on_token(tok)


def sent_ids(delivered: list[TokenEvent]) -> list[int]:
    """The answer's token ids the client has seen (a migration's resume_ids)."""
    return [t.id for t in delivered if t.id is not None]


def from_events(delivered: list[TokenEvent], metrics: Metrics) -> Completion:
    """An answer whose every token was sent before its agent died (nothing left
    to migrate): put together from what the client saw."""
    text = "".join(t.text for t in delivered if t.text and not t.is_reasoning)
    reasoning = "".join(t.text for t in delivered if t.text and t.is_reasoning)
    calls = [t.tool_call for t in delivered if t.tool_call is not None]
    ids = sent_ids(delivered)
    metrics.completion_tokens, metrics.finish_reason = len(ids), "length"
    return Completion(text, ids, metrics, "length", reasoning=reasoning, tool_calls=calls)


class Router:
    def __init__(self, pipelines: Iterable[Route], token: bytes | None = None) -> None:
        self.pipelines = {p.name: p for p in pipelines}
        self.token = token  # the cluster token the agents check
        self.lock = threading.Lock()
        self.busy: Counter[str] = Counter()
        self.down_until: dict[str, float] = {}
        self.health: dict[str, tuple[float, bool]] = {}
        self.last_ok: dict[str, float] = {}  # when each agent last answered /health ok
        self.affinity = affinity.AffinityTable()  # prefix -> the decode agent holding it
        self.cutting = threading.Event()  # set: every request stops at its next token

    def moved(self, name: str, host: str, port: int, control_port: int | None) -> None:
        """Agent `name` runs again at a new address (a restarted local agent): route
        to it there, and forget that it was down."""
        for pipe in self.pipelines.values():
            for ep in (*pipe.prefill, *pipe.decode):
                if ep.name == name:
                    ep.host, ep.port, ep.control_port = host, port, control_port
                    ep.hosts = [host] if ep.hosts else []
        with self.lock:
            self.down_until.pop(name, None)
            self.health.pop(name, None)
            self.last_ok.pop(name, None)

    def cut_all(self) -> None:
        """End every running request at its next token, as if its caller left (a
        gateway whose drain deadline passed); requests after this are cut too."""
        self.cutting.set()

    def models(self) -> list[str]:
        return list(self.pipelines)

    def pipeline(self, model: str | None) -> Route:
        if model is None and len(self.pipelines) == 1:
            return next(iter(self.pipelines.values()))
        if model is None:
            raise UsageError(
                f"several models are served ({', '.join(self.pipelines)}): "
                "pick one with -m MODEL (API: model=)"
            )
        if model not in self.pipelines:
            known = ", ".join(self.pipelines) or "none"
            raise UsageError(f"unknown model {model!r}: known models are {known}")
        return self.pipelines[model]

    def _healthy(self, ep: Endpoint) -> bool:
        now = time.monotonic()
        if self.down_until.get(ep.name, 0) > now:
            return False
        if ep.control_port is None:
            return True
        cached = self.health.get(ep.name)
        if cached and now - cached[0] < HEALTH_TTL_S:
            return cached[1]
        try:
            url = f"http://{ep.host}:{ep.control_port}/health"
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                answer = json.loads(resp.read(1 << 16))
            ok = isinstance(answer, dict) and answer.get("ok") is True
        except (OSError, ValueError, RecursionError) as e:
            ok = _timed_out(e) and now - self.last_ok.get(ep.name, -SLOW_GRACE_S) < SLOW_GRACE_S
        else:
            if ok:
                self.last_ok[ep.name] = now
        self.health[ep.name] = (now, ok)
        return ok

    def _mark_down(self, ep: Endpoint) -> None:
        with self.lock:
            self.down_until[ep.name] = time.monotonic() + DOWN_FOR_S
            self.health.pop(ep.name, None)
            self.last_ok.pop(ep.name, None)

    def order(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        """Healthy first, least busy first; unhealthy ones last, still worth a try."""
        with self.lock:
            busy = dict(self.busy)
        return sorted(endpoints, key=lambda ep: (not self._healthy(ep), busy.get(ep.name, 0)))

    def decode_order(
        self, endpoints: list[Endpoint], keys: list[affinity.PrefixKey]
    ) -> tuple[list[Endpoint], affinity.Choice]:
        """As order(), but the agent holding the request's longest remembered
        prefix goes first unless it is too busy (the rule: disagg.serving.affinity)."""
        with self.lock:
            busy = dict(self.busy)
        healthy = {ep.name: busy.get(ep.name, 0) for ep in endpoints if self._healthy(ep)}
        choice = affinity.choose(*self.affinity.match(keys), healthy)
        ordered = sorted(
            endpoints,
            key=lambda ep: (ep.name not in healthy, ep.name != choice.agent, busy.get(ep.name, 0)),
        )
        return ordered, choice

    def prefill_target(self, pipe: Route) -> PrefillTarget | None:
        """The pipeline's healthiest, least busy prefill agent, if it has one."""
        for ep in self.order(pipe.prefill):
            return ep.prefill_target(pipe.prefill_timeout_s, pipe.integrity)
        return None

    def run(
        self,
        model: str | None,
        request: GenerateRequest,
        on_token: Callable[[TokenEvent], None] | None = None,
        deadline_s: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Completion:
        """Run one request, moving it to another decode agent if one fails (sent
        nothing for the pipeline's decode_timeout_s, or died). `deadline_s` bounds
        the whole request, moves included (RequestTimeout); None: no bound.
        `cancel` set (the caller left): StopGeneration("cancelled") at once, even
        while the prompt still waits for its prefill (the agents then drop it).

        An agent that dies mid-answer is migrated, not replayed: the next agent
        takes the prompt plus the tokens already sent as its prompt
        (`resume_ids`) and decodes only the rest, so `on_token` sees each token
        once, and a seeded sampled request keeps its text. At most the pipeline's
        `max_migrations` moves per request.
        """
        pipe = self.pipeline(model)
        if pipe.embedding_only:
            raise UsageError(
                f"model {pipe.name}: this model serves embeddings only "
                "(/api/embed, /v1/embeddings); chat and generate need a chat pipeline",
                param="model",
            )
        req = request
        target = self.prefill_target(pipe)
        if target and req.prefill is None:
            req = req.replace(prefill=target)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        keys = affinity.prefix_keys(pipe.name, req)
        endpoints, choice = self.decode_order(pipe.decode, keys)
        j = Journey(pipe, req, on_token, deadline_s, keys, choice, cancel)
        for ep in endpoints:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RequestTimeout(
                    f"the request did not finish within its deadline of {deadline_s:g}s"
                    + (f" ({'; '.join(j.failures)})" if j.failures else "")
                )
            sent = sent_ids(j.delivered)
            if sent and j.migrations >= pipe.max_migrations:
                j.failures.append(f"max_migrations ({pipe.max_migrations}) reached")
                break
            if sent and len(sent) >= req.max_tokens:  # every token was out: none to decode
                j.migrations += 1
                return j.finished()
            result = self._try(j, ep, sent, left)
            if result is not None:
                return result
        if not j.failures:
            raise AgentError(f"pipeline {pipe.name} has no decode agent")
        raise AgentError(
            f"no decode agent of pipeline {pipe.name} could serve the request: "
            + "; ".join(j.failures)
        )

    def _try(
        self, j: Journey, ep: Endpoint, sent: list[int], left: float | None
    ) -> Completion | None:
        """One decode agent's try: its result, or None when it failed (marked down,
        the failure noted in `j`). With `sent`, a migration: the answer so far is
        prompt there."""
        req = j.req
        if sent:
            j.migrations += 1
            req = req.replace(resume_ids=sent, max_tokens=req.max_tokens - len(sent))
        forward = Relay(j.delivered, j.on_token, self.cutting)
        j.relays.append(forward)
        with self.lock:
            self.busy[ep.name] += 1
        try:
            result = wireclient.generate(
                ep.host,
                ep.port,
                req,
                on_token=forward,
                timeout_s=j.pipe.decode_timeout_s,
                token=self.token,
                deadline_s=left,
                cancel=j.cancel,
            )
            result.model = j.pipe.name
            m = result.metrics
            m.decode_server = m.decode_server or ep.name
            m.route = j.choice.to_dict()
            self.affinity.remember(j.keys, ep.name)  # it now holds this prompt's K/V
            m.rerouted_from = j.failures or None
            if sent:
                migrated(result, sent, j.migrations, j.relays[0], forward, j.failed_at)
            return result
        except RequestTimeout as e:  # no fault of the agent: not marked down
            raise RequestTimeout(
                f"the request did not finish within its deadline of {j.deadline_s:g}s: {e}"
            ) from None
        except (StopGeneration, wireclient.Cancelled) as caught:
            stop = caught if isinstance(caught, StopGeneration) else StopGeneration("cancelled")
            stop.metrics = m = forward.cut(stop.reason)
            m.decode_server = m.decode_server or ep.name
            m.route = j.choice.to_dict()
            m.migrations = j.migrations or None
            raise stop from None
        except (UsageError, ModelMismatch, AuthError):
            raise
        except (ConnectError, AgentError) as e:
            j.failed_at = time.perf_counter()
            self._mark_down(ep)
            j.failures.append(f"{ep.name}: {e}")
            return None
        finally:
            with self.lock:
                self.busy[ep.name] -= 1


@dataclass
class Journey:
    """One request on its way through a pipeline's decode agents."""

    pipe: Route
    req: GenerateRequest
    on_token: Callable[[TokenEvent], None] | None
    deadline_s: float | None
    keys: list[affinity.PrefixKey]
    choice: affinity.Choice
    cancel: threading.Event | None = None  # set: the caller left
    delivered: list[TokenEvent] = field(default_factory=list)  # what the client saw
    failures: list[str] = field(default_factory=list)
    migrations: int = 0
    relays: list[Relay] = field(default_factory=list)  # one per try
    failed_at: float = field(default_factory=time.perf_counter)  # the last failure

    def finished(self) -> Completion:
        """Every token was sent before the agent died: the answer from what was seen."""
        first = next((t.metrics for t in self.delivered if t.metrics is not None), None)
        m = Metrics.from_json(first.to_json()) if first is not None else Metrics()
        m.update(
            rerouted_from=self.failures or None,
            migrations=self.migrations,
            route=self.choice.to_dict(),
        )
        done = from_events(self.delivered, m)
        done.model = self.pipe.name
        return done


def migrated(
    result: Completion,
    sent: list[int],
    migrations: int,
    first: Relay,
    last: Relay,
    failed_at: float,
) -> None:
    """A migrated answer as one: the tokens sent before the last agent took over
    come first (its text already holds them: it parsed them as the answer's start).
    ttft is the client's first token (from the first agent); resume_time the gap
    from noticing the failure to the last agent's first token."""
    m = result.metrics
    result.token_ids = sent + result.token_ids
    m.migrations = migrations
    m.completion_tokens = len(result.token_ids)
    if first.t_first is not None:
        m.ttft = first.t_first - first.t_sent
    if last.t_first is not None:
        m.resume_time = last.t_first - failed_at

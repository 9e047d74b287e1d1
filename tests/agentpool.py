"""Agent sets for a test session: started once per configuration and shared.

A set is one prefill agent and `n_decode` decode agents on 127.0.0.1, serving one
model dir with one dtype and the same extra flags. Every pooled set is in one
cluster (a session token), so a test may cross sets (a decode agent asking another
set's prefill agent). A test that only sends requests shares its set with every
other test of the same configuration; a test that stops, kills, drains or restarts
an agent asks for a fresh set of its own (`fresh=True`), stopped when its fixture
scope ends.

Idle sets stay up until their memory is needed: when starting one more would put
the idle sets' resident memory over the budget, the least recently used idle set
stops first. A set a module's fixture holds is leased until that module ends; one a
test asks for in its body, until that test ends.

Flags an agent takes live (`PUT /settings`: connection caps, handshake deadline,
prefix-cache budget, stall timeout, `--allow-mixed`) are not part of a set's
configuration: the set is started without them and they are applied when it is
leased (the agent's own values again for a lease without them). A set held by a test
with other live values is not changed under it: the new lease gets a set of its own,
started with those flags on its command line.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from disagg.serving import localagents
from disagg.serving.localagents import AgentProc, make_token_file, stop_agents

# Idle pooled sets may hold this much resident memory (the box has 24 GiB, shared).
IDLE_BUDGET_BYTES = int(float(os.environ.get("DISAGG_TEST_POOL_GB", "9")) * (1 << 30))

# What this session started, by kind: "pooled" and "fresh" agent sets, "in-process"
# (a set the code under test started itself: a bench, the API's Client.local),
# "serve" (a `disagg serve --local` process's own agents, one set per model), "cli"
# (the same for a `disagg ... --local` run), "single" (one agent on its own),
# "fleet" (agents the test bed's `disagg start`/`restart`/`deploy` began); apart from
# those, "refused" (an agent that exited before loading anything), and what befell
# pooled sets ("evicted", "taken over").
STARTS: Counter[str] = Counter()
# Each start as (kind, what, the test running when it began): where they come from.
STARTED: list[tuple[str, str, str]] = []
CURRENT_TEST = ""  # set by conftest before each test's setup
# While a test's body runs: the sets it leased (Agents, set), released when it ends.
BODY_LEASES: list[tuple[Any, AgentSet]] | None = None
_KIND = contextvars.ContextVar("kind", default="in-process")


def count_start(kind: str, n: int = 1, what: str = "") -> None:
    if n:
        STARTS[kind] += n
        STARTED.extend([(kind, what, CURRENT_TEST)] * n)


@contextmanager
def starting(kind: str) -> Iterator[None]:
    token = _KIND.set(kind)
    try:
        yield
    finally:
        _KIND.reset(token)


_real_start = localagents.start_local_agents


def _counted_start(*args: Any, **kw: Any) -> tuple[AgentProc, list[AgentProc]]:
    count_start(
        _KIND.get(),
        what=f"{Path(args[0]).name} {kw.get('dtype', 'auto')} {kw.get('prefill_args', ())} "
        f"{kw.get('decode_args', ())} x{kw.get('n_decode', 1)}",
    )
    return _real_start(*args, **kw)


# Every set this process starts is counted, whoever starts it (imported before the
# modules that take the name: disagg.api, the benches).
localagents.start_local_agents = _counted_start


# Agent flags that are live settings (disagg_agents.runtime.settings): flag -> (name, type);
# a flag of type bool takes no value.
LIVE_FLAGS: dict[str, tuple[str, type]] = {
    "--handshake-timeout": ("handshake_timeout_s", float),
    "--max-connections": ("max_connections", int),
    "--max-preauth-per-peer": ("max_preauth_per_peer", int),
    "--prefix-cache-mb": ("prefix_cache_mb", float),
    "--kv-stall-timeout": ("kv_stall_timeout_s", float),
    "--allow-mixed": ("allow_mixed", bool),
}
Live = tuple[tuple[str, Any], ...]  # (setting, value), sorted: part of a SetKey


def split_live(args: Sequence[str]) -> tuple[tuple[str, ...], Live]:
    """An agent's flags as (those it needs at start, the live settings among them)."""
    start: list[str] = []
    live: dict[str, Any] = {}
    rest = list(args)
    while rest:
        flag = rest.pop(0)
        if flag not in LIVE_FLAGS:
            start.append(flag)
            continue
        name, kind = LIVE_FLAGS[flag]
        live[name] = True if kind is bool else kind(rest.pop(0))
    return tuple(start), tuple(sorted(live.items()))


def live_flags(live: Live) -> list[str]:
    """Live settings back as command-line flags (a set started with them)."""
    by_name = {name: flag for flag, (name, _) in LIVE_FLAGS.items()}
    out: list[str] = []
    for name, value in live:
        out += (
            [by_name[name]]
            if value is True
            else []
            if value is False
            else [by_name[name], str(value)]
        )
    return out


@dataclass(frozen=True)
class SetKey:
    model: Path
    dtype: str = "auto"
    n_decode: int = 1
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    prefill_model: Path | None = None  # the prefill agent's own dir (mixed weights)
    prefill_module: str | None = None  # the prefill agent run from a test's wrapper
    prefill_live: Live = ()  # live settings the set is leased with (not started with)
    decode_live: Live = ()
    own: bool = False  # a set of its own, its live flags on its command line

    @property
    def live(self) -> tuple[Live, Live]:
        return self.prefill_live, self.decode_live

    @property
    def shared(self) -> SetKey:
        """The set this configuration is leased from: no live settings."""
        return replace(self, prefill_live=(), decode_live=(), own=False)

    def describe(self) -> str:
        prefill = [*self.prefill_args, *live_flags(self.prefill_live)]
        decode = [*self.decode_args, *live_flags(self.decode_live)]
        flags = " ".join([*prefill, "|", *decode]).strip(" |")
        mixed = f" prefill on {self.prefill_model.name}" if self.prefill_model else ""
        return f"{self.model.name}{mixed} {self.dtype} x{self.n_decode} {flags}".strip()


@dataclass(eq=False)
class AgentSet:
    key: SetKey
    prefill: AgentProc
    decodes: list[AgentProc]
    leases: int = 0
    used_at: float = field(default_factory=time.monotonic)
    base: AgentSet | None = None  # the pooled set this one shows fewer decode agents of
    live: tuple[Live, Live] = ((), ())  # the live settings applied now
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)  # agent -> its own

    @property
    def pair(self) -> tuple[AgentProc, AgentProc]:
        return self.prefill, self.decodes[0]

    @property
    def agents(self) -> list[AgentProc]:
        return [self.prefill, *self.decodes]

    def rss_bytes(self) -> int:
        total = 0
        for agent in self.agents:
            try:
                status = Path(f"/proc/{agent.proc.pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total


class PoolError(RuntimeError):
    """A pooled agent died: some test stopped or killed a shared agent."""


class AgentPool:
    """`widths`: model dir -> decode agents its plain pooled set (no flags, dtype
    auto) always has; asking for fewer gets the first ones (one set of the default
    model for one-agent tests and two-agent routers alike)."""

    def __init__(
        self,
        root: Path,
        budget_bytes: int = IDLE_BUDGET_BYTES,
        widths: dict[Path, int] | None = None,
        pinned: set[SetKey] | None = None,
    ) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.widths = {m.resolve(): n for m, n in (widths or {}).items()}
        self.pinned = pinned or set()  # never stopped to make room
        self.token_file, self.token = make_token_file(root / "cluster")
        self.sets: dict[SetKey, AgentSet] = {}
        self.started = 0

    def _start(self, key: SetKey, log_dir: Path, token_file: Path | None) -> AgentSet:
        prefill, decodes = localagents.start_local_agents(
            key.model,
            n_decode=key.n_decode,
            dtype=key.dtype,
            log_dir=log_dir,
            token_file=token_file,
            prefill_args=[*key.prefill_args, *live_flags(key.prefill_live)],
            decode_args=[*key.decode_args, *live_flags(key.decode_live)],
            prefill_model_dir=key.prefill_model,
            prefill_module=key.prefill_module,
        )
        return AgentSet(key, prefill, decodes, live=key.live)

    def _apply(self, agent_set: AgentSet, live: tuple[Live, Live]) -> None:
        """Give the set's agents these live settings (their own values for the rest)."""
        agent_set = agent_set.base or agent_set
        if agent_set.live == live:
            return
        roles = [(agent_set.prefill, 0)] + [(d, 1) for d in agent_set.decodes]
        for agent, role in roles:
            if agent.name not in agent_set.defaults:  # read before anything changed
                agent_set.defaults[agent.name] = agent.settings()
            own = agent_set.defaults[agent.name]
            want = dict(live[role])
            change = {k: own[k] for k, _ in agent_set.live[role] if k not in want} | want
            if change:
                agent.settings(**change)
        agent_set.live = live

    def lease(self, key: SetKey) -> AgentSet:
        """The pooled set for `key`, started if it is not up; held until release()."""
        if not key.own:
            shared = self.sets.get(key.shared)
            held = shared is not None and (shared.leases > 0 and shared.live != key.live)
            if not held:
                got = self._lease(key.shared)
                try:
                    self._apply(got, key.live)
                except BaseException:
                    self.release(got)
                    raise
                return got
            key = replace(key, own=True)  # held with other live values: not changed under it
        return self._lease(key)

    def _lease(self, key: SetKey) -> AgentSet:
        plain = (
            key.dtype == "auto"
            and not (key.prefill_args or key.decode_args or key.prefill_module)
            and key.live == ((), ())
        )
        width = self.widths.get(key.model, 0) if plain and key.prefill_model is None else 0
        wide = replace(key, n_decode=max(key.n_decode, width))
        if wide != key:
            base = self._lease(wide)
            return AgentSet(key, base.prefill, base.decodes[: key.n_decode], base=base)
        found = self.sets.get(key)
        if found is not None:
            dead = [a for a in found.agents if not a.alive()]
            if dead:
                del self.sets[key]
                stop_agents(found.agents)
                raise PoolError(
                    f"pooled agent {dead[0].name} ({key.describe()}) exited with "
                    f"{dead[0].proc.returncode}; log {dead[0].log_path}. A test that "
                    "stops, kills or drains an agent must ask for a fresh set (fresh=True); "
                    "the next test that asks for this set gets a new one."
                )
        else:
            self._make_room()
            with starting("pooled"):
                self.started += 1
                found = self._start(key, self.root / f"set-{self.started}", self.token_file)
            self.sets[key] = found
        found.leases += 1
        found.used_at = time.monotonic()
        return found

    def lease_prefill(self, model: Path, dtype: str = "auto") -> AgentSet:
        """A pooled set whose prefill agent serves `model` as a plain one does (any
        set of it with no prefill flags), else the plain set, started."""
        model = model.resolve()
        for key in self.sets:
            plain = (key.model, key.dtype, key.prefill_args, key.prefill_model, key.prefill_module)
            if plain == (model, dtype, (), None, None):
                return self.lease(key)
        return self.lease(key_for(model, dtype=dtype))

    def release(self, agent_set: AgentSet) -> None:
        agent_set = agent_set.base or agent_set
        agent_set.leases -= 1
        agent_set.used_at = time.monotonic()

    def fresh(self, key: SetKey, log_dir: Path, token_file: Path | None = None) -> AgentSet:
        """A set of the caller's own (its own token unless given): the caller stops it.
        An idle pooled set of the same configuration is handed over instead of starting
        one where the caller takes the pool's token (none given, or the pool's): a
        start now, or maybe one later if it is asked for again, never worse."""
        idle = self.sets.get(key.shared)
        if (
            token_file in (None, self.token_file)
            and idle is not None
            and idle.leases <= 0
            and all(a.alive() for a in idle.agents)
        ):
            self._apply(idle, key.live)
            del self.sets[key.shared]
            count_start("taken over", what=key.describe())
            return idle
        with starting("fresh"):
            return self._start(key, log_dir, token_file)

    def _make_room(self) -> None:
        idle = sorted(
            (s for s in self.sets.values() if s.leases <= 0 and s.key not in self.pinned),
            key=lambda s: s.used_at,
        )
        held = sum(s.rss_bytes() for s in idle)
        while idle and held > self.budget_bytes:
            oldest = idle.pop(0)
            held -= oldest.rss_bytes()
            del self.sets[oldest.key]
            stop_agents(oldest.agents)
            count_start("evicted", what=oldest.key.describe())

    def close(self) -> None:
        stop_agents([a for s in self.sets.values() for a in s.agents])
        self.sets.clear()


def key_for(
    model: Path,
    *,
    dtype: str = "auto",
    n_decode: int = 1,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    prefill_model: Path | None = None,
    prefill_module: str | None = None,
) -> SetKey:
    prefill_start, prefill_live = split_live(prefill_args)
    decode_start, decode_live = split_live(decode_args)
    return SetKey(
        model.resolve(),
        dtype,
        n_decode,
        prefill_start,
        decode_start,
        prefill_model.resolve() if prefill_model else None,
        prefill_module,
        prefill_live,
        decode_live,
    )

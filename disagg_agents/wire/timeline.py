"""Where a request's time went, typed once: `Metrics.timeline`, what `disagg
serve`'s web view draws.

`at` is the Unix time the decode agent took the request; every other phase is
seconds after it on that agent's clock (another host's clock never enters, so
skew cannot bend a bar). The decode agent writes it (disagg_agents.decode.events,
and `at` + `first_token` on the first TOKEN frame), the router adds `done` to a
request cut short. The JSON is the releases' that sent a dict: a phase the run
did not have is left out, one it named without a time is null. Stdlib only:
agents ship alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


def _time(v: Any) -> float | None:
    """A phase's time as sent, None when it is not a number (JSON's bools are not)."""
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Timeline:
    """A request's phases: `at` (Unix time), the rest seconds after it."""

    at: float | None = None  # the decode agent took the request
    prefill_start: float | None = None  # remote: PREFILL sent + the prefill agent's queue
    prefill_end: float | None = None
    kv_first: float | None = None  # K/V layers arriving (remote prefills)
    kv_last: float | None = None
    first_token: float | None = None
    joined: float | None = None  # entered the decode batch
    done: float | None = None  # the last token
    # Phases the document names though they have no time (JSON null): a remote
    # prefill whose K/V never arrived, an answer that never joined the batch.
    # Kept to those that are None, so equal timelines are equal documents.
    nulls: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        named = frozenset(n for n in self.nulls if n in PHASES and getattr(self, n) is None)
        object.__setattr__(self, "nulls", named)

    def as_json(self) -> dict[str, float | None]:
        """The phases the run had, in their order; null where named without a time."""
        out: dict[str, float | None] = {}
        for name in PHASES:
            value = getattr(self, name)
            if value is not None or name in self.nulls:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Timeline:
        """A timeline as sent: a phase that is not a number reads as null (a
        hostile agent costs its own field only); names not known are dropped."""
        times = {name: _time(d[name]) for name in PHASES if name in d}
        nulls = frozenset(name for name, t in times.items() if t is None)
        return cls(**times, nulls=nulls)

    @classmethod
    def read(cls, v: Any) -> Timeline | None:
        """A metrics document's `timeline`: None unless it is an object."""
        if isinstance(v, Timeline):
            return v
        return cls.from_json(v) if isinstance(v, Mapping) else None


PHASES = tuple(f.name for f in fields(Timeline) if f.name != "nulls")

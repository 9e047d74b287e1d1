"""Limits an operator changes on a running agent (`PUT /settings` on the control
port, token holders only): a new connection cap, handshake deadline or prefix-cache
budget needs no restart, so the model stays loaded and the caches stay warm.

A change is all or nothing: every name and value is checked before any is applied,
and one line says what was wrong."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg_agents.prefix.disk import DiskTier
    from disagg_agents.prefix.store import BlockStore

MAX_CHANGES = 32  # names in one change; there are fewer settings than this
MAX_BODY_BYTES = 4096  # a PUT /settings body, at most


class SettingsError(ValueError):
    """A change refused as a whole: one line for the operator."""


@dataclass(frozen=True)
class Setting:
    """One live setting: its type (float, int or bool), range, and how to read and
    apply it. `apply` runs under the registry's lock, one change at a time."""

    name: str
    kind: type
    get: Callable[[], Any]
    apply: Callable[[Any], None]
    low: float | None = None
    high: float | None = None
    help: str = ""

    def check(self, value: object) -> Any:
        if self.kind is bool:
            if not isinstance(value, bool):
                raise SettingsError(f"{self.name} takes true or false, not {value!r}"[:200])
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingsError(f"{self.name} takes a number, not {value!r}"[:200])
        if isinstance(value, int) and abs(value) > 1 << 53:  # 400 digits: float() overflows
            raise SettingsError(f"{self.name} must lie in {self.bounds()}")
        if self.kind is int and not float(value).is_integer():
            raise SettingsError(f"{self.name} takes a whole number, not {value!r}")
        if not math.isfinite(value):
            raise SettingsError(f"{self.name} takes a finite number")
        if (self.low is not None and value < self.low) or (
            self.high is not None and value > self.high
        ):
            raise SettingsError(f"{self.name} must lie in {self.bounds()}: {value!r}")
        return int(value) if self.kind is int else float(value)

    def bounds(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        return f"[{low}, {'inf' if self.high is None else f'{self.high:g}'}]"


class Settings:
    """The agent's live settings by name."""

    def __init__(self, *settings: Setting) -> None:
        self._all: dict[str, Setting] = {}
        self._lock = threading.Lock()
        self.add(*settings)

    def add(self, *settings: Setting) -> None:
        for s in settings:
            self._all[s.name] = s

    def values(self) -> dict[str, Any]:
        with self._lock:
            return {name: s.get() for name, s in sorted(self._all.items())}

    def change(self, raw: object) -> dict[str, list[Any]]:
        """Apply `raw` ({name: value}) whole, or raise SettingsError having applied
        nothing; returns {name: [old, new]} for what changed."""
        if not isinstance(raw, dict) or not raw:
            raise SettingsError('a change is a JSON object, e.g. {"max_connections": 64}')
        if len(raw) > MAX_CHANGES:
            raise SettingsError(f"at most {MAX_CHANGES} settings in one change")
        checked: dict[str, Any] = {}
        for name, value in raw.items():
            setting = self._all.get(name) if isinstance(name, str) else None
            if setting is None:
                known = ", ".join(sorted(self._all))
                raise SettingsError(f"no setting {str(name)[:64]!r}; this agent has: {known}")
            checked[name] = setting.check(value)
        changed: dict[str, list[Any]] = {}
        with self._lock:
            for name, value in checked.items():
                old = self._all[name].get()
                if old != value:
                    self._all[name].apply(value)
                    changed[name] = [old, value]
        return changed


def attr_setting(
    name: str,
    owner: object,
    attr: str,
    kind: type,
    low: float | None = None,
    high: float | None = None,
    help: str = "",
) -> Setting:
    """A plain attribute of `owner`, read where it is used, as a live setting."""
    return Setting(
        name, kind, lambda: getattr(owner, attr), lambda v: setattr(owner, attr, v), low, high, help
    )


def budget_setting(cache: BlockStore) -> Setting:
    """A prefix cache's budget as a live setting: a smaller one evicts at once."""
    return Setting(
        "prefix_cache_mb",
        float,
        lambda: round(cache.max_bytes / (1 << 20), 4),
        lambda mb: cache.set_budget(int(mb * (1 << 20))),
        0.0,
        float(memory_mb()),
        "memory for prompt K/V reused across requests (0: off)",
    )


def disk_setting(disk: DiskTier) -> Setting:
    """The prefix cache's disk tier budget as a live setting: a smaller one evicts
    at once; 0 empties the directory and turns the tier off (`disagg tune` clears it)."""
    return Setting(
        "prefix_disk_mb",
        float,
        lambda: round(disk.max_bytes / (1 << 20), 4),
        lambda mb: disk.set_budget(int(mb * (1 << 20))),
        0.0,
        float(1 << 24),
        "disk for prompt K/V kept across restarts (0: empty it, off)",
    )


def tenant_share_setting(cache: BlockStore, disk: DiskTier | None = None) -> Setting:
    """What one tenant's prompts may hold of a prefix cache (and of its disk tier)
    while another's are cached."""

    def apply(share: float) -> None:
        for tier in (cache, disk):
            if tier is not None:
                tier.tenant_share = share

    return Setting(
        "prefix_tenant_share",
        float,
        lambda: cache.tenant_share,
        apply,
        0.05,
        1.0,
        "of the prefix cache, what one API key's prompts may hold while another's are cached",
    )


def memory_mb() -> int:
    """The machine's memory in MB (a prefix cache larger than it is a typo); 1 TB
    when the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20
    except (ValueError, OSError, AttributeError):
        return 1 << 20

"""What every benchmark section shares: the run's stamp (date, load, elapsed),
the machine it ran on, a deterministic long prompt, a local agent pair and the
disaggregated request through it, medians, and the cells of the tables."""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.table import Table

from disagg.serving.defaultmodel import Say
from disagg.units import fmt
from disagg_agents.runtime import fastblas
from disagg_agents.wire.frames import PeerAuthError

if TYPE_CHECKING:
    from disagg.serving.localagents import AgentProc
    from disagg.serving.wireclient import Result
    from disagg_agents.wire.answer import TokenEvent

__all__ = ["Say"]

Pair = tuple["AgentProc", "AgentProc"]  # (prefill, decode)

DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
COLORS = ("red", "green", "blue", "amber", "violet", "grey")


T = TypeVar("T")


def need(value: T | None, what: str = "metric") -> T:
    """A metric the bench cannot go on without: an error where the run had none."""
    if value is None:
        raise ValueError(f"the run reported no {what}")
    return value


def quiet(_msg: str) -> None:
    """The default `say`: no progress lines."""


# ---- numbers ----------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def median_or_none(xs: Sequence[float]) -> float | None:
    return median(xs) if xs else None


# ---- the prompt ---------------------------------------------------------------------------


def long_text(count_tokens: Callable[[str], int], target: int) -> str:
    """Deterministic text of about `target` tokens: the longest word prefix that fits."""
    lines = (
        f"Entry {i}: the {COLORS[i % len(COLORS)]} box on shelf {i % 17} "
        f"holds {i * 7 % 31} stones and {i * 11 % 13} coins."
        for i in range(target)  # every line is several tokens: more than enough
    )
    words = ("Here is an inventory.\n" + "\n".join(lines)).split(" ")
    return fitting_prefix(words, count_tokens, target)


def fitting_prefix(words: list[str], count_tokens: Callable[[str], int], target: int) -> str:
    """The longest prefix of `words` (joined by spaces) of at most `target` tokens:
    a binary search, since tokens grow with words."""
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


# ---- the run and the machine -------------------------------------------------------------


def loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


@dataclass
class Stamp:
    """When a run started and the machine's load then. Other work on the machine
    skews every number: a 1-minute load average well above 0 at either end means
    the run should be repeated."""

    date: str = field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )
    t0: float = field(default_factory=time.perf_counter)
    load_start: float | None = field(default_factory=loadavg)

    def load_avg_1m(self) -> dict[str, float | None]:
        return {"start": self.load_start, "end": loadavg()}

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(torch_device: str, mlx_device: str) -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": version("transformers"),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_blas": fastblas.loaded,
        "prefill_device": torch_device,
        "decode_device": mlx_device,
    }


def agent_device(agent: AgentProc) -> str | None:
    """The device an agent reports on its control endpoint, if it answers."""
    try:
        return str(agent.status()["device"])
    except (OSError, ValueError, KeyError, PeerAuthError):
        return None


def pair_machine_info(prefill: AgentProc, decode: AgentProc) -> dict[str, Any]:
    """`machine_info` with the devices the two agents report (cpu / mlx's default if not)."""
    import mlx.core as mx

    info = machine_info(
        torch_device=agent_device(prefill) or "cpu",
        mlx_device=agent_device(decode) or str(mx.default_device()),
    )
    try:  # the decode agent's own BLAS (mlx_blas is this process's, for the mlx-lm baselines)
        info["decode_blas"] = str(decode.status()["blas"])
    except (OSError, ValueError, KeyError, PeerAuthError):
        info["decode_blas"] = None
    return info


# ---- a local agent pair and the disaggregated request through it ---------------------------


@contextmanager
def local_pair(model_dir: Path, say: Say) -> Iterator[Pair]:
    """A prefill and a decode agent on 127.0.0.1, stopped on the way out."""
    from disagg.serving.localagents import start_local_pair, stop_agents

    say("starting prefill and decode agents")
    prefill, decode = start_local_pair(model_dir)
    try:
        yield prefill, decode
    finally:
        stop_agents([decode, prefill])


def disaggregated(
    prefill: AgentProc,
    decode: AgentProc,
    request: dict[str, Any],
    timeout_s: float = 900.0,
) -> tuple[Result, list[float]]:
    """Run `request` on `decode` with its KV from `prefill`; the result and each
    token's arrival (perf_counter seconds). Raises AgentError unless disaggregated."""
    from disagg.serving.checkedrequest import build_request
    from disagg.serving.pair import run_remote

    stamps: list[float] = []

    def on_token(ev: TokenEvent) -> None:
        if ev.id is not None:
            stamps.append(time.perf_counter())

    # The whole prompt every time (benches repeat prompts; `bench prefix` measures the cache).
    req = build_request(**{"prefix_cache": False, **request})
    return run_remote(prefill, decode, req, on_token=on_token, timeout_s=timeout_s), stamps


# ---- table cells -------------------------------------------------------------------------


def table(
    title: str, columns: Sequence[str], caption: str | None = None, left: Sequence[str] = ()
) -> Table:
    """A bench table: bold header; numbers right-aligned, the `left` columns not."""
    t = Table(title=title, header_style="bold", caption=caption)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    return t


def verdict(ok: bool) -> str:
    return "[green]pass[/]" if ok else "[red]FAIL[/]"


def num(x: Any, unit: str) -> str:
    """`x` with its unit, as `disagg.units.fmt` writes it (inf and nan as they are)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return fmt(x, unit)


def cell(x: float | None, scale: float = 1.0, form: str = "{:.3f}") -> str:
    """`x` x `scale` in `form`, or "-" when there is none."""
    return "-" if x is None else form.format(x * scale)

"""Whether other work holds this machine's cores right now (Linux's /proc).

OpenBLAS's threads spin while they wait for each other: with two of them on a
2-core machine where two other processes run, every gemm waits for a thread the
scheduler has parked, and a SmolLM2 decode step took 10-30x longer than on one
thread (docs/performance.md, "Beside two busy processes"). The load average
reacts in a minute and counts this agent's own spinning threads; the number of
runnable tasks now, less this process's own, says at once whether someone else
wants the cores.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from pathlib import Path

PROC_STAT = Path("/proc/stat")
OWN_TASKS = Path("/proc/self/task")


def others_running() -> int | None:
    """Runnable tasks on the machine that are not this process's; None off Linux."""
    try:
        stat = PROC_STAT.read_text()
    except OSError:
        return None
    total = next(
        (int(line.split()[1]) for line in stat.splitlines() if line.startswith("procs_running")),
        None,
    )
    if total is None:
        return None
    return max(0, total - own_running())


def own_running() -> int:
    """This process's threads in state R (running or runnable)."""
    n = 0
    try:
        tasks = list(OWN_TASKS.iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            # "pid (comm) S ...": the state follows the last ")" (comm may hold spaces).
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        n += state == "R"
    return n


class FreeCores:
    """Cores nobody else wants, as the median of the last `window` samples (one
    sample is an instant; a burst of a compiler or a cron job should not flip the
    thread count back and forth)."""

    def __init__(self, cores: int | None = None, window: int = 5) -> None:
        self.cores = cores or os.cpu_count() or 1
        self.samples: deque[int] = deque(maxlen=window)

    def sample(self, others: int | None = None) -> int | None:
        """Take one sample (or `others` given): free cores, at least 1; None off Linux."""
        others = others_running() if others is None else others
        if others is None:
            return None
        self.samples.append(others)
        return max(1, self.cores - int(statistics.median_high(self.samples)))

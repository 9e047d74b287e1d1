"""The prefix cache's disk tier for agents started on this machine (`serve --local`,
`generate --local`): on by default, under the cache dir, bounded.

Each decode agent gets a directory of its own under the root (one per model and
agent: two agents never share one), and the local cluster's token is kept in the
root (0600, `make_token_file`) instead of a fresh one per start: the tier's MAC key
and the tenants' cache salts come from it, so a restart's agents find the blocks
the last run wrote.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from disagg.errors import UsageError
from disagg.serving.defaultmodel import Say, cache_root

DEFAULT_MB = 4096  # per decode agent, at most; less on a disk with little room
FREE_SHARE = 0.1  # of the free space where the root lives, at most


@dataclass(frozen=True)
class LocalDisk:
    """Where local decode agents keep prefix blocks, and how much each may."""

    root: Path
    mb: float

    def agent_dir(self, model: str, agent: str) -> Path:
        """One agent's directory: by model and by the agent's own name."""
        return self.root / _safe(model) / _safe(agent.split("@")[0])


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "_"


def default_root() -> Path:
    return cache_root() / "prefix-disk"


def default_mb(root: Path) -> float:
    """DEFAULT_MB, or a tenth of the free space there when that is less."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return 0.0
    return float(min(DEFAULT_MB, int(free * FREE_SHARE) >> 20))


def local_disk(directory: str | None, mb: float | None, say: Say) -> LocalDisk | None:
    """The tier as the flags ask (`mb` 0: off; None: the defaults); None, with a
    line said, when its directory cannot be made ours."""
    if mb is not None and mb < 0:
        raise UsageError(f"--prefix-disk-mb must be 0 (off) or more, got {mb:g}")
    if mb == 0:
        return None
    root = Path(directory).expanduser() if directory else default_root()
    mb = default_mb(root) if mb is None else mb
    if mb <= 0:
        say(f"prefix disk tier off: no free space at {root}")
        return None
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if root.stat().st_uid != os.getuid():
            raise PermissionError(f"{root} belongs to another user")
        os.chmod(root, 0o700)
    except OSError as e:
        say(f"prefix disk tier off: {root}: {e.strerror or e}")
        return None
    return LocalDisk(root, mb)

"""The `disagg` command line: parses, calls the library, renders. Nothing imports it."""

from __future__ import annotations

from disagg.cli import bench as _bench  # noqa: F401  (registers the `bench` sub-app)
from disagg.cli import commands as _commands  # noqa: F401  (registers generate, serve, ...)
from disagg.cli import fleet as _fleet  # noqa: F401  (registers deploy, start, status, ...)
from disagg.cli import plan as _plan  # noqa: F401  (registers plan)
from disagg.cli.common import app


def main() -> None:
    app()

"""What the bench tests share: a section run as the CLI runs it, and the check
that a measured number is one."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def run_section(
    run: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any
) -> tuple[dict[str, Any], list[str]]:
    """`run(*args, **kwargs)` with a `say` that must hear progress: its report,
    checked to be plain (JSON-able) data, and the progress lines."""
    messages: list[str] = []
    report = run(*args, say=messages.append, **kwargs)
    assert messages
    json.dumps(report)
    return report, messages

"""A decode agent whose grammar compiles take S seconds longer, so a test can hang
up mid-compile. Test-only: the shipped agent has no such flag.

`python -m tests.slowgrammar --compile-delay S <the agent's flags>` runs the real
decode agent (`disagg_agents.decode`) with each compile sleeping S seconds on its pool
thread before llguidance builds the matcher.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

FLAG = "--compile-delay"


def main() -> None:
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # as disagg_agents.decode's main
    from disagg_agents.decode import agent, grammar

    argv = sys.argv[1:]
    at = argv.index(FLAG)
    delay_s = float(argv[at + 1])
    sys.argv = [sys.argv[0], *argv[:at], *argv[at + 2 :]]
    build = grammar.Grammars._build

    def slow(tok: Any, write: Callable[[], str], *rest: Any) -> tuple[Any, int]:
        time.sleep(delay_s)
        return build(tok, write, *rest)  # the field, the compile check, the budget

    grammar.Grammars._build = staticmethod(slow)  # type: ignore[method-assign,assignment]
    agent.main()


if __name__ == "__main__":
    main()

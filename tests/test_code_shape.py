"""The code's shape, held by reading it: functions short enough to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 80  # a function, nested ones included, outside the CLI
MAX_CLI_LINES = 100  # a typer command: its flags alone take a line each
AGENT_CORE_MAX_LINES = 60  # disagg_agents/runtime/ and wire/
# The request path (front doors, serving, the API): read most, changed most.
MAX_SERVING_LINES = 60
SERVING_PATH = ("disagg/frontends", "disagg/serving", "disagg/api.py")


def long_functions(root: Path, limit: int, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if any(rel.startswith(s) for s in skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_over_80_lines_outside_the_cli() -> None:
    assert long_functions(REPO / "disagg_agents", MAX_LINES) == []
    assert long_functions(REPO / "disagg", MAX_LINES, ("disagg/cli/",)) == []


def test_no_function_over_60_lines_in_the_agents_runtime_and_wire() -> None:
    # What every agent runs and every frame passes through: held tighter.
    for pkg in ("runtime", "wire"):
        assert long_functions(REPO / "disagg_agents" / pkg, AGENT_CORE_MAX_LINES) == []


def test_no_function_over_60_lines_on_the_request_path() -> None:
    found = [f for p in SERVING_PATH for f in long_functions(REPO / p, MAX_SERVING_LINES)]
    assert found == []


def test_no_cli_command_over_100_lines() -> None:
    assert long_functions(REPO / "disagg" / "cli", MAX_CLI_LINES) == []


def test_the_reader_counts_nested_functions(tmp_path: Path) -> None:
    probe = REPO / "tests" / "_shape_probe"
    probe.mkdir()
    try:
        body = "".join(f"        x{i} = {i}\n" for i in range(5))
        (probe / "m.py").write_text(f"def outer():\n    def inner():\n{body}    return inner\n")
        assert long_functions(probe, 4) == [
            "tests/_shape_probe/m.py:1 outer (8 lines)",
            "tests/_shape_probe/m.py:2 inner (6 lines)",
        ]
    finally:
        (probe / "m.py").unlink()
        probe.rmdir()

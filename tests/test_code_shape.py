"""The code's shape, held by reading it: functions short enough to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 60  # a function, nested ones included, outside the CLI
MAX_PARAMS = 6  # a decode pipeline function's parameters: more is state for its Job
MAX_CLI_LINES = 100  # a typer command: its flags alone take a line each


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


def many_parameters(root: Path, limit: int) -> list[str]:
    """Functions under `root` taking more than `limit` parameters: self and cls not
    counted, *args and **kwargs one each."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                named = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                n = len([p for p in named if p not in ("self", "cls")])
                n += (a.vararg is not None) + (a.kwarg is not None)
                if n > limit:
                    out.append(f"{rel}:{node.lineno} {node.name} ({n} parameters)")
    return out


def test_no_function_over_60_lines_outside_the_cli() -> None:
    assert long_functions(REPO / "disagg_agents", MAX_LINES) == []
    assert long_functions(REPO / "disagg", MAX_LINES, ("disagg/cli/",)) == []


def test_no_decode_function_takes_more_than_6_parameters() -> None:
    assert many_parameters(REPO / "disagg_agents" / "decode", MAX_PARAMS) == []


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


def test_the_parameter_count_leaves_out_self_and_counts_star_args() -> None:
    probe = REPO / "tests" / "_params_probe"
    probe.mkdir()
    try:
        (probe / "m.py").write_text(
            "class C:\n"
            "    def ok(self, a, b, c, d, e, f): pass\n"
            "    def over(self, a, b, c, d, e, *rest, **kw): pass\n"
            "def kwonly(a, b, c, d, *, e, f, g): pass\n"
        )
        assert many_parameters(probe, 6) == [
            "tests/_params_probe/m.py:3 over (7 parameters)",
            "tests/_params_probe/m.py:4 kwonly (7 parameters)",
        ]
    finally:
        (probe / "m.py").unlink()
        probe.rmdir()

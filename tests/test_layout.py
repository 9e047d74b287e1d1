"""The architecture's import rules, held by reading every module's imports.

- `agents` ships alone to the hosts: it never imports `disagg`.
- Only `disagg.cli` imports typer; nothing imports `disagg.cli`.
- rich only in `disagg.cli` and the benchmarks' tables (`disagg.bench`).
- Arrows run one way, up: `disagg.serving` (what the API is built on) never imports
  the API or the front doors; the API never imports the front doors
  (`disagg.frontends`: gateways, guard, batch runner).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at any depth in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def violations(package: str, forbidden: str, allowed_under: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in modules(package):
        rel = path.relative_to(REPO).as_posix()
        if any(rel.startswith(a) for a in allowed_under):
            continue
        for name in imports(path):
            if name == forbidden or name.startswith(forbidden + "."):
                out.append(f"{rel} imports {name}")
    return out


def test_agents_never_import_disagg() -> None:
    assert violations("agents", "disagg") == []


def test_only_cli_imports_typer() -> None:
    assert violations("disagg", "typer", ("disagg/cli/",)) == []
    assert violations("agents", "typer") == []


def test_nothing_imports_the_cli() -> None:
    assert violations("disagg", "disagg.cli", ("disagg/cli/",)) == []
    assert violations("agents", "disagg.cli") == []


def test_rich_only_in_cli_and_bench() -> None:
    assert violations("disagg", "rich", ("disagg/cli/", "disagg/bench/")) == []
    assert violations("agents", "rich") == []


def test_serving_never_imports_the_api_or_front_doors() -> None:
    assert violations("disagg/serving", "disagg.api") == []
    assert violations("disagg/serving", "disagg.frontends") == []
    assert violations("disagg/fleet", "disagg.frontends") == []


def test_the_api_never_imports_the_front_doors() -> None:
    api = REPO / "disagg" / "api.py"
    assert not [n for n in imports(api) if n.startswith("disagg.frontends")]


@pytest.mark.parametrize(
    "source, forbidden, expected",
    [
        ("import disagg.api\n", "disagg", ["x.py imports disagg.api"]),
        ("def f():\n    from typer import Option\n", "typer", ["x.py imports typer"]),
        ("from . import disagg\n", "disagg", []),  # relative: the package's own module
    ],
)
def test_the_rule_reader_sees_imports(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    forbidden: str,
    expected: list[str],
) -> None:
    # The checker itself must catch an import anywhere in a file, or the rules prove nothing.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "x.py").write_text(source)
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = violations("pkg", forbidden)
    assert [f.replace("pkg/", "") for f in found] == expected

"""The architecture's import rules, held by reading every module's imports.

- `agents` ships alone to the hosts: it never imports `disagg`.
- Only `disagg.cli` imports typer; nothing imports `disagg.cli`.
- rich only in `disagg.cli` and the benchmarks' tables (`disagg.bench`).
- Arrows run one way, up: `disagg.serving` (what the API is built on) never imports
  the API or the front doors; the API never imports the front doors
  (`disagg.frontends`: gateways, guard, batch runner).
- The benchmarks (`disagg.bench`) sit beside the serving path, never on it: no
  module under `disagg.bench` is reachable from the front doors, serving, the
  API, the fleet, the agents or `disagg serve`'s own module, walking every
  import (those inside functions too, and the packages each one runs).
- Each front door's request and answer types (`disagg.frontends.<api>.types`)
  stand apart from its routes: they reach no routes module and no fastapi; the
  OpenAI and Ollama front doors never import each other (`app` mounts both).
"""

from __future__ import annotations

import ast
from collections import deque
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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in ("disagg", "agents") for p in modules(pkg)}


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """Our modules a file imports, at any depth in the file, with the packages
    above each (their `__init__` runs too); `from a import b` counts `a.b` when it
    is a module; relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets += [base] + [f"{base}.{a.name}" for a in node.names]
    found: set[str] = set()
    for target in targets:
        parts = target.split(".")
        found.update(
            m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in known
        )
    return found


def reachable(
    roots: list[str], known: dict[str, Path], opaque: tuple[str, ...] = ()
) -> dict[str, str]:
    """Every module reachable from `roots`, each with the chain that reaches it.
    `opaque` modules are reached but not walked into."""
    chain = {r: r for r in roots}
    todo = deque(roots)
    while todo:
        mod = todo.popleft()
        if mod in opaque:
            continue
        for nxt in sorted(imported_modules(known[mod], known)):
            if nxt not in chain:
                chain[nxt] = f"{chain[mod]} -> {nxt}"
                todo.append(nxt)
    return chain


def test_no_bench_module_is_reachable_from_the_serving_path() -> None:
    known = our_modules()
    starts = ("disagg.frontends", "disagg.serving", "disagg.api", "disagg.fleet", "agents")
    roots = [m for m in known if any(m == s or m.startswith(s + ".") for s in starts)]
    # `disagg serve`'s module. The CLI package's __init__ registers every command,
    # the bench sub-app too, whose commands import the benches only when they run
    # (tests/test_bench_cli.py checks what a real process loads): not walked into.
    roots.append("disagg.cli.commands")
    chain = reachable(roots, known, opaque=("disagg.cli",))
    assert [c for m, c in chain.items() if m.startswith("disagg.bench")] == []


FRONT_DOORS = ("openai", "ollama")


@pytest.mark.parametrize("api", FRONT_DOORS)
def test_front_door_types_stand_apart_from_their_routes(api: str) -> None:
    known = our_modules()
    types = f"disagg.frontends.{api}.types"
    chain = reachable([types], known)
    assert [c for m, c in chain.items() if m.rpartition(".")[2] == "routes"] == []
    assert not [n for n in imports(known[types]) if n == "fastapi" or n.startswith("fastapi.")]


@pytest.mark.parametrize("api, other", [FRONT_DOORS, FRONT_DOORS[::-1]])
def test_front_doors_never_import_each_other(api: str, other: str) -> None:
    known = our_modules()
    roots = [m for m in known if m.startswith(f"disagg.frontends.{api}.")]
    chain = reachable(roots, known)
    assert [c for m, c in chain.items() if m.startswith(f"disagg.frontends.{other}")] == []


def test_the_graph_walker_sees_lazy_relative_and_package_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "disagg"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bench" / "__init__.py").write_text("")
    (pkg / "bench" / "x.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from disagg import bench\n")
    (pkg / "c.py").write_text("import disagg.bench.x\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    known = our_modules()
    assert reachable(["disagg.a"], known)["disagg.bench"] == (
        "disagg.a -> disagg.b -> disagg.bench"
    )
    assert {"disagg", "disagg.bench", "disagg.bench.x"} <= set(reachable(["disagg.c"], known))
    assert "disagg.bench" not in reachable(["disagg.a"], known, opaque=("disagg.b",))


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


def test_the_agents_ship_no_fault_injection() -> None:
    # Tests stretch the K/V stream with their own wrapper (tests/slowprefill.py).
    found = [
        p.relative_to(REPO).as_posix()
        for p in modules("agents")
        if "--fault" in p.read_text() or "layer_delay" in p.read_text()
    ]
    assert found == []


def long_functions(package: str, limit: int = 80) -> list[str]:
    """Functions (nested ones too) over `limit` lines, decorators not counted."""
    out = []
    for path in modules(package):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(REPO).as_posix()}:{node.name} {lines}")
    return out


@pytest.mark.parametrize("package", ["disagg/frontends", "disagg/bench"])
def test_no_function_over_80_lines(package: str) -> None:
    assert long_functions(package) == []

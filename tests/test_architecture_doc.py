"""docs/architecture.md's tree is the packages: every package (and no other) has its
line, and every module of a package is named on its lines. A module added, moved or
renamed without the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("disagg_agents", "disagg")


def tree_block() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## The tree, one job per package", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def documented() -> dict[str, str]:
    """package path -> the text of its lines (a line whose first word ends in "/"
    opens a package, nested by two spaces; other lines continue the one above)."""
    out: dict[str, str] = {}
    stack: list[str] = []
    current = ""
    for line in tree_block():
        words = line.split()
        if not words:
            continue
        first, depth = words[0], (len(line) - len(line.lstrip())) // 2
        if first.endswith("/"):
            stack = [*stack[:depth], first.rstrip("/")]
            current = "/".join(stack)
            out[current] = line[line.index(first) + len(first) :]
        else:
            out[current] += " " + line.strip()
    return out


def packages() -> dict[str, set[str]]:
    """package path -> its modules (no __init__, no __main__)."""
    out = {}
    for root in ROOTS:
        for init in sorted((REPO / root).rglob("__init__.py")):
            pkg = init.parent
            mods = {p.stem for p in pkg.glob("*.py")} - {"__init__", "__main__"}
            out[str(pkg.relative_to(REPO))] = mods
    return out


def test_the_tree_has_a_line_for_every_package_and_no_other() -> None:
    assert set(documented()) == set(packages())


def test_every_module_is_named_on_its_packages_lines() -> None:
    doc = documented()
    missing = {}
    for pkg, mods in packages().items():
        named = set(re.findall(r"[A-Za-z_][\w]*", doc.get(pkg, "")))
        if lost := sorted(m for m in mods if m not in named):
            missing[pkg] = lost
    assert missing == {}

"""What each role's Python needs on a host, read from one place: pyproject's
`[prefill]` / `[decode]` extras (plus the agents' base, numpy and zstandard, from
its dependencies). A source checkout's pyproject.toml wins over the installed
distribution's metadata, which can be older. Environment markers are kept:
the host's own pip evaluates them (`mlx[cpu]` on Linux, `mlx` on macOS).
"""

from __future__ import annotations

import re
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AGENT_BASE = ("numpy", "zstandard")  # what the agents import beyond the stdlib, either role
# Installed where pip's markers say (triton: Linux), used where present: a host without
# it (a Mac prefilling on MPS) still runs the role, so its check does not ask for it.
OPTIONAL_MODULES = ("triton",)
_EXTRA = re.compile(r"""\s*(?:and\s+)?extra\s*==\s*["']([\w.-]+)["']\s*(?:and\s+)?""")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower()


@cache
def _declared() -> tuple[list[str], dict[str, list[str]]]:
    """(dependencies, extras by name), from pyproject.toml or the installed metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "disagg":
            extras = project.get("optional-dependencies", {})
            return list(project.get("dependencies", [])), {k: list(v) for k, v in extras.items()}
    return from_metadata(metadata.requires("disagg") or [])


def from_metadata(requires: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Split a distribution's Requires-Dist lines into dependencies and extras,
    each extra's `extra == "..."` clause dropped from its marker."""
    deps: list[str] = []
    by_extra: dict[str, list[str]] = {}
    for raw in requires:
        spec, _, marker = raw.partition(";")
        found = _EXTRA.search(marker)
        if not found:
            deps.append(raw)
            continue
        rest = _EXTRA.sub(" ", marker).strip()
        line = f"{spec.strip()}; {rest}" if rest else spec.strip()
        by_extra.setdefault(found.group(1), []).append(line)
    return deps, by_extra


def role_requirements(role: str) -> list[str]:
    """pip requirement strings for a host running `role` (markers included)."""
    deps, extras = _declared()
    if role not in extras:
        raise KeyError(f"pyproject declares no [{role}] extra")
    base = [d for d in deps if _name(d) in AGENT_BASE]
    return [*(r.strip() for r in extras[role] if _name(r) != "disagg"), *base]


def role_modules(role: str) -> list[str]:
    """The import names the role's requirements provide (mlx-lm -> mlx_lm), less the
    optional ones."""
    names = {_name(r).replace("-", "_") for r in role_requirements(role)}
    return sorted(names - set(OPTIONAL_MODULES))

"""The README and docs/ hold together: every relative link lands on a file (and an
`#anchor` on a heading), and every `disagg ...` command the README shows is one
that `disagg --help` lists. Pure text, no agents: runs in the fast tier."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.core import TyperGroup
from typer.main import get_command
from typer.testing import CliRunner

from disagg.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
# `disagg WORD` where disagg is the command itself: at a line's start, after a
# prompt, or after a shell operator (not `from disagg import`, not `disagg.cli`).
COMMAND = re.compile(r"(?:^|[;&|]\s*|\$\s+)disagg[ \t]+(\S+)", re.M)


def prose(text: str) -> str:
    """The text without fenced blocks and inline code: what links and headings are."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    targets = LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{doc.relative_to(ROOT)}: {broken}"


def test_docs_are_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    top = sorted((ROOT / "docs").glob("*.md"))
    assert top, "docs/ holds no markdown"
    assert [p.name for p in top if p.resolve() not in linked] == []


def listed_commands() -> set[str]:
    """The command names in `disagg --help`'s command list."""
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    panel = result.output.split("Commands", 1)[1]
    # rich draws "│ name  help", plain click "  name  help"; wrapped help lines
    # start with more spaces, so they never match.
    names = set(re.findall(r"^(?:│ |  )([a-z][\w-]*)(?=\s|$)", panel, re.M))
    group = get_command(app)
    assert isinstance(group, TyperGroup)
    ctx = group.make_context("disagg", ["--help"], resilient_parsing=True)
    visible = set()
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is not None and not cmd.hidden:
            visible.add(name)
    assert names == visible, f"help parsed as {sorted(names)}, the app has {sorted(visible)}"
    return names


def readme_commands() -> list[str]:
    """The first word after `disagg` in every shell line of the README's code
    blocks and in its inline code (python blocks hold no shell lines)."""
    text = README.read_text(encoding="utf-8")
    words = []
    for block in FENCE.finditer(text):
        if block.group(2).strip().lower() not in ("python", "py", "json", "toml"):
            words += COMMAND.findall(block.group(3))
    for span in INLINE_CODE.findall(FENCE.sub("", text)):
        words += COMMAND.findall(span.strip("`"))
    return words


def test_readme_commands_are_ones_disagg_help_lists() -> None:
    words = readme_commands()
    assert len(words) >= 5, f"found too few commands to trust the scan: {words}"
    listed = listed_commands()
    unknown = sorted({w for w in words if not w.startswith("-") and w not in listed})
    assert unknown == [], f"README shows disagg {unknown}; `disagg --help` lists {sorted(listed)}"

"""`disagg --help` lists each command by one summary that reads whole at 80 columns:
a docstring's first paragraph is one line, so rich never keeps a hard break inside
a sentence."""

from __future__ import annotations

import typer.main

from disagg.cli import app

# `plan`'s help is being rewritten with the command itself (issue 44).
PENDING: set[str] = set()


def test_each_commands_summary_is_one_line() -> None:
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        if name in PENDING:
            continue
        first = (cmd.help or "").strip().split("\n\n")[0]
        assert "\n" not in first, (name, first)
        assert len(first) <= 2 * (80 - 12), (name, first)  # two lines of the list at most


def each_command(group: object, prefix: str = "") -> list[tuple[str, object]]:
    found = []
    for name, cmd in getattr(group, "commands", {}).items():
        found.append((prefix + name, cmd))
        found += each_command(cmd, f"{prefix}{name} ")
    return found


def test_every_help_paragraph_wraps_as_one() -> None:
    """`disagg plan --help` broke its second paragraph after "Mac" and "mlx-lm on":
    every paragraph of every command's help is one line for rich to wrap."""
    found = each_command(typer.main.get_command(app))
    assert any(name == "plan" for name, _ in found) and any(" " in n for n, _ in found)
    for name, cmd in found:
        for para in (getattr(cmd, "help", None) or "").strip().split("\n\n"):
            assert para.startswith("\b") or "\n" not in para, (name, para)

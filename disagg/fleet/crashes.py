"""An agent's last error, from the ends of its files: a crash's traceback lands
in ROLE.stderr (what the agent could not log), a logged failure in ROLE.log.
Text only (no SSH here): `operations.crash_line` runs the command on the host,
the web view reads local agents' logs with `last_error_in`."""

from __future__ import annotations

import shlex

from disagg_agents.wire.text import printable


def last_error_in(lines: list[str]) -> str | None:
    """The line a crash ends with (`RuntimeError: ...` after a traceback), or the
    last ERROR / FAILED line; None if neither."""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("Traceback (most recent call last)"):
            tail = [x for x in lines[i + 1 :] if x and not x.startswith((" ", "\t"))]
            return printable(tail[0] if tail else line, 300)
        if " ERROR " in line or line.startswith("FAILED "):
            return printable(line, 300)
    return None


FILE_MARK = "@file "


def crash_tail_command(stderr_path: str, log_path: str, n: int = 60) -> str:
    """The ends of the agent's stderr and log, each after a line with the file's
    change time (`date -r`: GNU and BSD alike)."""
    parts = [
        f"echo '{FILE_MARK}'$(date -r {shlex.quote(f)} +%s 2>/dev/null || echo 0); "
        f"tail -n {n} {shlex.quote(f)} 2>/dev/null"
        for f in (stderr_path, log_path)
    ]
    return "; ".join(parts)


def last_error_from_tails(out: str) -> str | None:
    """What crash_tail_command printed -> the last error of the file changed last
    (a crash's traceback lands in stderr; a logged failure in the log)."""
    files: list[tuple[int, list[str]]] = []
    for line in out.splitlines():
        if line.startswith(FILE_MARK):
            stamp = line[len(FILE_MARK) :].strip()
            files.append((int(stamp) if stamp.isdigit() else 0, []))
        elif files:
            files[-1][1].append(line)
    for _, lines in sorted(files, key=lambda f: -f[0]):
        found = last_error_in(lines)
        if found:
            return found
    return None

"""The gateway's API keys: from DISAGG_API_KEY, `--api-key`, or a file only its
owner may read (one key per line, each its own prefix-cache tenant)."""

from __future__ import annotations

import os
from pathlib import Path

from disagg.errors import UsageError

KEY_MIN_CHARS = 16
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_key(key: str, where: str) -> str:
    if any(c.isspace() for c in key) or not key.isprintable():
        raise UsageError(f"{where}: an API key is one word of printable characters")
    if len(key) < KEY_MIN_CHARS:
        raise UsageError(
            f"{where}: the API key has {len(key)} characters, at least {KEY_MIN_CHARS} are "
            f"needed; make one with {MAKE_ONE}"
        )
    return key


def read_key_file(path: Path) -> list[str]:
    """The keys in `path`, refusing a file others may read (as the cluster token)."""
    try:
        mode = os.stat(path).st_mode
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"cannot read --api-key-file {path}: {e.strerror}") from None
    if mode & 0o077:
        raise UsageError(f"--api-key-file {path} is readable by others; fix: chmod 600 {path}")
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(check_key(line, f"{path} line {n}"))
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key; {MAKE_ONE} makes one")
    return keys


def api_keys(given: str | None, path: Path | None) -> list[str]:
    """The keys the gateway takes; [] when it wants none."""
    if given is not None and path is not None:
        raise UsageError("give --api-key (or DISAGG_API_KEY) or --api-key-file, not both")
    if path is not None:
        return read_key_file(path)
    if given is None:
        return []
    return [check_key(given.strip(), "--api-key / DISAGG_API_KEY")]

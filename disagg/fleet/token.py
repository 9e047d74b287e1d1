"""The cluster token: one secret shared by the operator and every agent of an
inventory. Agents check it (challenge-response on the KV socket, bearer on
HTTP); deploy copies it to each host (0600); the client proves itself with it.

It lives outside the inventory, which people commit: in $DISAGG_TOKEN_FILE, or
~/.config/disagg/tokens/<inventory name>-<hash of its path>.token.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from disagg.errors import AuthError
from disagg_agents.wire.auth import TOKEN_MIN_CHARS


def token_path(inventory_path: Path) -> Path:
    if os.environ.get("DISAGG_TOKEN_FILE"):
        return Path(os.environ["DISAGG_TOKEN_FILE"]).expanduser()
    where = hashlib.sha256(str(inventory_path.resolve()).encode()).hexdigest()[:10]
    return Path.home() / ".config" / "disagg" / "tokens" / f"{inventory_path.stem}-{where}.token"


def load_token(inventory_path: Path, create: bool = False) -> bytes | None:
    """The token for this inventory; with create=True, made on first use (deploy)."""
    path = token_path(inventory_path)
    if path.is_file():
        if path.stat().st_mode & 0o077:
            raise AuthError(f"token file {path} is readable by others; fix: chmod 600 {path}")
        token = path.read_bytes().strip()
        if len(token) < TOKEN_MIN_CHARS:
            what = "is empty" if not token else f"holds only {len(token)} characters"
            raise AuthError(
                f"token file {path} {what}, a cluster token has at least {TOKEN_MIN_CHARS}; "
                f"fix: rm {path} and run disagg deploy to make a new one for every host"
            )
        return token
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path.read_bytes().strip()

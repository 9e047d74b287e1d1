"""The web view's sign-in, the way Jupyter does it: `/ui?key=KEY` (or the key
form) once, then an HttpOnly, SameSite=Strict cookie scoped to /ui.

The cookie holds no key: it is an HMAC of the key's digest under a secret made
when the process starts, so it dies with the gateway and a copy of it never
reveals the key. It opens only the web view's own data (`/ui/api/...`), never
the model APIs, so no other page can spend tokens through a visitor's browser.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

COOKIE = "disagg_ui"
COOKIE_PATH = "/ui"
DATA_PREFIX = "/ui/api/"  # what the cookie opens
_SECRET = secrets.token_bytes(32)  # per process: a restart signs everyone out


def key_digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


def key_matches(given: str, digest: bytes) -> bool:
    # Digests: equal lengths, so the compare leaks nothing about the key.
    return hmac.compare_digest(key_digest(given.strip()), digest)


def session_value(digest: bytes) -> str:
    return hmac.new(_SECRET, digest, hashlib.sha256).hexdigest()


def set_cookie_header(digest: bytes) -> str:
    # No Domain: the browser sends it back to this host only; Path keeps it off /v1, /api.
    return f"{COOKIE}={session_value(digest)}; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict"


def cookie_from(headers: Mapping[bytes, bytes]) -> str | None:
    raw = headers.get(b"cookie", b"").decode("latin-1")
    for part in raw.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


def signed_in(headers: Mapping[bytes, bytes], digest: bytes) -> bool:
    given = cookie_from(headers)
    return given is not None and hmac.compare_digest(given, session_value(digest))


def is_open_path(path: str) -> bool:
    """The page shell, its sign-in and its static assets: no data, open to all."""
    return path in ("/ui", "/ui/", "/ui/login") or path.startswith("/ui/assets/")


def cookie_opens(path: str) -> bool:
    return path.startswith(DATA_PREFIX)

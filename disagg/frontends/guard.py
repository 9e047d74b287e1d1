"""Who may call the gateway, how much they may send, and what a client that
hung up costs: an API key checked on every route, bodies capped, decoding
stopped when nobody waits for the answer."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import threading
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, Protocol

from starlette.requests import Request

from disagg.frontends import tenancy

MAX_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 30.0  # a request's whole body must arrive within this (a trickle is cut)
OPEN_PATHS = frozenset({"/", "/health"})  # liveness only: no model, no data
DISCONNECT_POLL_S = 0.25

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# Each API's error body for a path (the app's: it mounts the APIs), from the
# path, status, message and OpenAI-family code. Without one: `{"error": message}`.
ErrorBody = Callable[[str, int, str, str], dict[str, Any]]


def plain_error_body(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    return {"error": message}


class WebView(Protocol):
    """The web view's sign-in as the guard asks it (the app passes
    disagg.frontends.webview.auth): its open pages, and a cookie for its data."""

    def is_open_path(self, path: str) -> bool: ...
    def cookie_opens(self, path: str) -> bool: ...
    def signed_in(self, headers: Mapping[bytes, bytes], digest: bytes) -> bool: ...


class NoWebView:
    """A gateway without a web view: nothing open, no cookie honoured."""

    def is_open_path(self, path: str) -> bool:
        return False

    def cookie_opens(self, path: str) -> bool:
        return False

    def signed_in(self, headers: Mapping[bytes, bytes], digest: bytes) -> bool:
        return False


# -- tenants -------------------------------------------------------------------
# Each API key is a tenant. Routes read what the guard found in the request's
# scope["state"]: the tenant's prefix-cache salt and whether it holds a key.
TENANT = tenancy.TENANT  # the matching key's digest (None: the gateway wants no key)
SALT_KEY = "disagg_salt_key"
OPERATOR = tenancy.OPERATOR  # True: the caller sees the whole fleet (tenancy.is_operator)
INTERNALS_HEADER = b"x-disagg-internals"  # "1": a keyed caller asks for the metrics' internals


def _state(request: Request) -> dict[str, Any]:
    state = request.scope.get("state")
    return state if isinstance(state, dict) else {}


def cache_salt(request: Request, asked: str | None = None) -> str | None:
    """The prefix-cache salt for this request: derived from the caller's API key
    (never the key itself), or from `asked` (the body's `cache_salt`: callers who
    pass the same one share, whatever their key). None: no keys and none asked."""
    state = _state(request)
    secret, tenant = state.get(SALT_KEY), state.get(TENANT)
    if not isinstance(secret, bytes):
        return asked
    if asked is not None:
        return "s" + hmac.new(secret, b"asked|" + asked.encode(), hashlib.sha256).hexdigest()[:32]
    if tenant is None:
        return None
    return "t" + hmac.new(secret, b"key|" + tenant, hashlib.sha256).hexdigest()[:32]


def tenant_tag(request: Request) -> str | None:
    """The caller's tenant as agents see it: an HMAC of its key's digest (not the
    key, not its cache_salt, which a caller picks), None without a key."""
    state = _state(request)
    secret, tenant = state.get(SALT_KEY), state.get(TENANT)
    if not isinstance(secret, bytes) or not isinstance(tenant, bytes):
        return None
    return hmac.new(secret, b"tenant|" + tenant, hashlib.sha256).hexdigest()[:32]


def salt_key(secret: bytes | None) -> bytes:
    """The key salts are HMACs under, so nobody can tell an API key from its salt:
    derived from the cluster token (`secret`), the same after a restart, so blocks
    on a decode agent's disk stay the tenant's; without a token, this process's own."""
    if not secret:
        return secrets.token_bytes(32)
    return hmac.new(secret, b"disagg tenant cache salts", hashlib.sha256).digest()


def wants_internals(request: Request) -> bool:
    """Addresses, fallback reasons, reroutes and other tenants' load (route.busy) go
    to the operator's key only, when it asks; another tenant's header is ignored."""
    asked = dict(request.scope.get("headers") or []).get(INTERNALS_HEADER, b"") == b"1"
    state = _state(request)
    return asked and state.get(TENANT) is not None and tenancy.is_operator(request)


class Guard:
    """ASGI middleware: the API keys (`Authorization: Bearer KEY` or `x-api-key: KEY`, compared in
    constant time; each key a tenant) and the body cap, before any route sees
    the request."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | Sequence[str] | None,
        max_body: int = MAX_BODY_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
        error_body: ErrorBody = plain_error_body,
        web_view: WebView | None = None,
        salt_secret: bytes | None = None,
    ):
        self.app = app
        self.error_body = error_body
        self.webauth = web_view or NoWebView()
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]
        self.key_digest = self.key_digests[0] if self.key_digests else None
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.salt_key = salt_key(salt_secret)

    def tenant(self, scope: Scope) -> bytes | None:
        """The digest of the caller's key, if it holds one of ours."""
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1").strip()
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer":
            # Anthropic's clients send the key as x-api-key.
            given = headers.get(b"x-api-key", b"").decode("latin-1")
            if not given.strip():
                return None
        # Digests: equal lengths, so the compare leaks nothing about the key.
        digest = hashlib.sha256(given.strip().encode()).digest()
        found = None
        for d in self.key_digests:  # all of them: the time does not say which matched
            if hmac.compare_digest(digest, d):
                found = d
        return found

    def web_view(self, scope: Scope) -> bool:
        """The web view: its page shell is open; its sign-in cookie opens its data only."""
        path = scope["path"]
        if self.webauth.is_open_path(path):
            return True
        headers = dict(scope.get("headers") or [])
        key = self.key_digest
        return (
            key is not None
            and self.webauth.cookie_opens(path)
            and self.webauth.signed_in(headers, key)
        )

    def authorized(self, scope: Scope) -> bool:
        tenant = self.tenant(scope) if self.key_digests else None
        state = scope.setdefault("state", {})
        # The operator: the first key (or its web view cookie), or anyone when no key is wanted.
        operator = not self.key_digests or (tenant is not None and tenant == self.key_digest)
        state.update({TENANT: tenant, SALT_KEY: self.salt_key, OPERATOR: operator})
        if not self.key_digests or scope["path"] in OPEN_PATHS or tenant is not None:
            return True
        if self.web_view(scope):
            state[OPERATOR] = not self.webauth.is_open_path(scope["path"])
            return True
        return False

    async def reply(self, send: Send, path: str, status: int, message: str, code: str) -> None:
        await _reply(send, self.error_body(path, status, message, code), status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if not self.authorized(scope):
            await self.reply(
                send, path, 401, "unauthorized: send Authorization: Bearer KEY", "invalid_api_key"
            )
            return
        too_big = f"request body over {self.max_body} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await self.reply(send, path, 413, too_big, "request_too_large")
            return
        # Read the body here (it is small by now) so a chunked one is capped too;
        # pieces joined once (a `+=` per piece is quadratic in 1-byte pieces).
        pieces: list[bytes] = []
        size, more = 0, True
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    piece = message.get("body", b"")
                    pieces.append(piece)
                    size += len(piece)
                    more = message.get("more_body", False)
                    if size > self.max_body:
                        await self.reply(send, path, 413, too_big, "request_too_large")
                        return
        except TimeoutError:
            late = f"request body not received within {self.body_timeout_s:g}s"
            await self.reply(send, path, 408, late, "request_timeout")
            return
        body = b"".join(pieces)
        if body and path.startswith(JSON_PATHS):
            json_whatever_the_type(scope)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect when the client leaves

        mark = tenancy.enter(scope["state"].get(TENANT), scope["state"].get(OPERATOR) is True)
        try:
            await self.app(scope, replay, send)
        finally:
            tenancy.leave(mark)


JSON_PATHS = ("/api/", "/v1/")


def json_whatever_the_type(scope: Scope) -> None:
    """Read the body as JSON whatever its content type, as Ollama does: `curl -d`
    sends application/x-www-form-urlencoded, `requests.post(data=...)` none."""
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
    scope["headers"] = [*headers, (b"content-type", b"application/json")]


async def _reply(send: Send, body: dict[str, Any], status: int) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


async def unless_gone(request: Request, run: Callable[[threading.Event], Awaitable[Any]]) -> Any:
    """Await `run(cancel)`; if the client hangs up first, set `cancel` (decoding
    stops at the next token) and wait for the run to end."""
    cancel = threading.Event()
    task = asyncio.ensure_future(run(cancel))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                cancel.set()
                return await task
    finally:
        cancel.set()


def for_caller(request: Any, message: str) -> str:
    """`message` as this caller may read it: agents' addresses only for the operator
    (a tenant's 503 once read `decode agent 127.0.0.1:41385: connection closed`)."""
    return message if tenancy.is_operator(request) else tenancy.for_tenant(message)

"""Who may call the gateway, how much they may send, and what a client that
hung up costs: an API key checked on every route, bodies capped, decoding
stopped when nobody waits for the answer."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request

from disagg.frontends.webview import auth as webauth

MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = frozenset({"/", "/health"})  # liveness only: no model, no data
DISCONNECT_POLL_S = 0.25

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_body(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    """The error in the shape of the API the path belongs to: OpenAI under /v1,
    Ollama's `{"error": "..."}` elsewhere."""
    if path.startswith("/v1"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return {"error": message}


class Guard:
    """ASGI middleware: the API key (`Authorization: Bearer KEY`, compared in
    constant time) and the body cap, before any route sees the request."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.max_body = max_body

    def authorized(self, scope: Scope) -> bool:
        if self.key_digest is None or scope["path"] in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        # The web view: its page shell is open; its sign-in cookie opens its data only.
        if webauth.is_open_path(scope["path"]):
            return True
        if webauth.cookie_opens(scope["path"]) and webauth.signed_in(headers, self.key_digest):
            return True
        auth = headers.get(b"authorization", b"").decode("latin-1").strip()
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # Digests: equal lengths, so the compare leaks nothing about the key.
        return hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), self.key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if not self.authorized(scope):
            await _reply(
                send, path, 401, "unauthorized: send Authorization: Bearer KEY", "invalid_api_key"
            )
            return
        too_big = f"request body over {self.max_body} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _reply(send, path, 413, too_big, "request_too_large")
            return
        # Read the body here (it is small by now) so a chunked one is capped too.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await _reply(send, path, 413, too_big, "request_too_large")
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect when the client leaves

        await self.app(scope, replay, send)


async def _reply(send: Send, path: str, status: int, message: str, code: str) -> None:
    raw = json.dumps(error_body(path, status, message, code)).encode()
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

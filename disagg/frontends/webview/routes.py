"""The web view's routes: the page at /ui, its sign-in, its assets, the data it
polls (/ui/api/state) and the gateway's Prometheus text (/metrics)."""

from __future__ import annotations

import asyncio
import gzip
import html
import json
import time
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)

from disagg.frontends.tenancy import is_operator, tenant_of
from disagg.frontends.webview.auth import key_digest, key_matches, set_cookie_header, signed_in
from disagg.frontends.webview.fleet import FleetWatch
from disagg.frontends.webview.tracker import RequestLog

ASSETS = {"ui.css": "text/css", "ui.js": "text/javascript", "favicon.svg": "image/svg+xml"}
# The page loads nothing from elsewhere, and no other site may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def _asset(name: str) -> bytes:
    return (resources.files("disagg.frontends.webview") / "assets" / name).read_bytes()


def _login_page(error: str = "") -> HTMLResponse:
    body = _asset("login.html").decode().replace("{{error}}", html.escape(error))
    return HTMLResponse(body, status_code=401 if error else 200, headers=PAGE_HEADERS)


def routes(client: Any, api_key: str | None = None, log: RequestLog | None = None) -> APIRouter:
    """The router; it starts recording every request `client.router` runs (in `log`)."""
    log = log or RequestLog(client.models())
    # The one door every gateway request goes through (see tracker.py).
    setattr(client.router, "run", log.wrap(client.router.run))  # noqa: B010
    fleet = FleetWatch(client, log)
    digest = key_digest(api_key) if api_key else None
    r = APIRouter()

    def signed_in_here(request: Request) -> bool:
        return digest is None or signed_in(dict(request.scope.get("headers") or []), digest)

    def app_page() -> HTMLResponse:
        return HTMLResponse(_asset("ui.html"), headers=PAGE_HEADERS)

    def sign_in(given: str) -> Response:
        assert digest is not None
        if not key_matches(given, digest):
            return _login_page("That key is not the gateway's API key.")
        # 303: the browser GETs /ui, so the key leaves the address bar and history.
        headers = {"Set-Cookie": set_cookie_header(digest), **PAGE_HEADERS}
        return RedirectResponse("/ui", status_code=303, headers=headers)

    @r.get("/ui", response_model=None)
    @r.get("/ui/", response_model=None, include_in_schema=False)
    async def page(request: Request, key: str | None = None) -> Response:
        if digest is None:
            return app_page()
        if key is not None:
            return sign_in(key)
        return app_page() if signed_in_here(request) else _login_page()

    @r.post("/ui/login", response_model=None)
    async def login(request: Request) -> Response:
        if digest is None:
            return RedirectResponse("/ui", status_code=303)
        form = parse_qs((await request.body()).decode(errors="replace"))
        return sign_in((form.get("key") or [""])[0])

    @r.get("/ui/assets/{name}", response_model=None)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return PlainTextResponse("no such asset", status_code=404)
        return Response(
            _asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"}
        )

    _data_routes(r, fleet, log)
    return r


def _data_routes(r: APIRouter, fleet: FleetWatch, log: RequestLog) -> None:
    """The page's data and the Prometheus scrape: the fleet for the operator only."""

    @r.get("/ui/api/state")
    async def state(request: Request) -> Response:
        # The fleet and everyone's requests for the operator; a tenant its own.
        operator = is_operator(request)
        agents = await asyncio.to_thread(fleet.poll) if operator else []
        body = {
            "now": time.time(),
            "models": [p.name for p in fleet.pipelines()],
            "agents": agents,
            "links": fleet.links() if operator else [],
            "requests": log.snapshot(tenant_of(request), everyone=operator),
            "operator": operator,
        }
        raw = json.dumps(body, separators=(",", ":")).encode()
        headers = {"Cache-Control": "no-store"}
        # Polled every second, up to 300 requests: gzip makes that ~10x smaller for a phone.
        if "gzip" in request.headers.get("accept-encoding", ""):
            raw = gzip.compress(raw, compresslevel=5)
            headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        return Response(raw, media_type="application/json", headers=headers)

    @r.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> PlainTextResponse:
        operator = is_operator(request)
        if operator:
            await asyncio.to_thread(fleet.poll)  # agent_up is as fresh as the scrape
        text = log.metrics.text(fleet=operator)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

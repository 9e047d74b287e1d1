"""The gateway app (FastAPI): four APIs on one port (OpenAI's Chat Completions and
Responses, and Anthropic's Messages under /v1; Ollama's under /api), behind one
guard (`disagg.frontends.guard`: API keys, body caps), with the web view at /ui and
generation on a bounded pool (`disagg.frontends.workers`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from disagg.api import Client
from disagg.frontends import webview
from disagg.frontends.anthropic import routes as anthropic_routes
from disagg.frontends.anthropic.types import AnthropicError, anthropic_error_body
from disagg.frontends.embeddings import routes as embedding_routes
from disagg.frontends.guard import MAX_BODY_BYTES, Guard, for_caller
from disagg.frontends.ollama import routes as ollama_routes
from disagg.frontends.ollama.types import OllamaError
from disagg.frontends.openai import routes as openai_routes
from disagg.frontends.openai.types import OpenAIError
from disagg.frontends.refusal import ApiError
from disagg.frontends.responses import routes as responses_routes
from disagg.frontends.webview import auth as webauth
from disagg.frontends.webview.tracker import RequestLog, watch_begun
from disagg.frontends.workers import Workers


def create_app(
    client: Client,
    *,
    api_key: str | Sequence[str] | None = None,
    max_body: int = MAX_BODY_BYTES,
    workers: Workers | None = None,
) -> FastAPI:
    """The gateway: OpenAI's API under /v1 and Ollama's under /api, one port.
    With `api_key` (one, or several: each a tenant), every route but `/` and
    `/health` wants one as a bearer token. Generation runs on `workers` (default:
    sized to the cluster's batch capacity), which refuses requests past its limit."""
    app = FastAPI(title="disagg gateway")
    log = RequestLog(client.models())
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body=max_body,
        error_body=error_body,
        web_view=webauth,
        salt_secret=client.router.token,
    )
    app.add_middleware(ListRefusals, log=log)  # outermost: sees the guard's 401s and 413s
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    pool = workers or Workers.for_router(client.router, keys=len(keys))
    # Before Ollama's: its catch-all /api/{what} answers what it does not serve.
    app.include_router(embedding_routes.routes(client, pool))
    app.include_router(ollama_routes.routes(client, pool))
    # /ui, /ui/api/..., /metrics; the web view's sign-in takes the first key.
    app.include_router(webview.routes(client, keys[0] if keys else None, log))
    app.include_router(openai_routes.routes(client, pool))
    app.include_router(anthropic_routes.routes(client, pool))
    app.include_router(responses_routes.routes(client, pool))
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    return app


def error_body(path: str, status: int, message: str, code: str) -> dict[str, Any]:
    """The error in the shape of the API the path belongs to: Anthropic's under
    /v1/messages, OpenAI's elsewhere under /v1, Ollama's `{"error": "..."}` elsewhere
    (the guard's 401, 408 and 413 answer in it)."""
    if path.startswith("/v1/messages"):
        return anthropic_error_body(status, message)
    if path.startswith("/v1"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return ApiError(status, message, kind, None, code).body()
    return {"error": message}


class ListRefusals:
    """ASGI middleware: requests answered 4xx (an unknown path or model, a bad body, no
    key) are listed in the web view beside the ones that ran."""

    def __init__(self, app: Any, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith("/ui") or path == "/metrics":
            await self.app(scope, receive, send)
            return

        status, body = 0, b""
        begun = watch_begun()  # a request that ran is listed already, error and all

        async def watch(message: Any) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                status = 0 if begun else message["status"]
            elif message["type"] == "http.response.body" and status:
                body = (body + message.get("body", b""))[:8192]
                if not message.get("more_body"):
                    self.log.refused(Request(scope).method, path, status, error_message(body))
                    status = 0
            await send(message)

        await self.app(scope, receive, watch)


def error_message(body: bytes) -> str | None:
    """The message of an error body in any of the APIs' shapes: OpenAI's and
    Anthropic's {"error": {"message"}}, Ollama's {"error": "..."}, FastAPI's detail."""
    try:
        got = json.loads(body)
    except ValueError:
        return None
    if not isinstance(got, dict):
        return None
    err = got.get("error", got.get("detail"))
    if isinstance(err, dict):
        err = err.get("message")
    return err if isinstance(err, str) else None


def add_error_handlers(app: FastAPI) -> None:
    """Each API's errors in its own shape; a body that fails validation too."""

    # A server error's text may name agents: their addresses go to the operator only.
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        if e.status >= 500:
            e.message = for_caller(request, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(AnthropicError)
    async def _anthropic_error(request: Request, e: AnthropicError) -> JSONResponse:
        if e.status >= 500:
            e.message = for_caller(request, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(OllamaError)
    async def _ollama_error(request: Request, e: OllamaError) -> JSONResponse:
        message = for_caller(request, e.message) if e.status >= 500 else e.message
        return JSONResponse({"error": message}, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _invalid_fields(request, list(e.errors()))

    # A field of the wrong type found while mapping a body onto chat (a tool result's
    # `tool_use_id: 5`): the caller's error, not a 500 with a traceback.
    @app.exception_handler(ValidationError)
    async def _invalid_inner(request: Request, e: ValidationError) -> JSONResponse:
        return _invalid_fields(request, list(e.errors()))


def _invalid_fields(request: Request, errors: list[Any]) -> JSONResponse:
    """A 400 in the door's shape, naming the first field that failed validation."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(400, msg), status_code=400)
    if not request.url.path.startswith("/v1"):
        return JSONResponse({"error": msg}, status_code=400)
    err = OpenAIError(400, msg, "invalid_request_error", ".".join(loc) or None)
    return JSONResponse(err.body(), status_code=400)

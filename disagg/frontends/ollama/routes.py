"""Ollama's API over a disagg Client, so Ollama clients (the `ollama` Python and JS
libraries, Open WebUI, editor plugins) use the cluster unchanged.

GET /api/tags, /api/ps, /api/version; POST /api/show, /api/generate, /api/chat
(NDJSON streaming by default, one object with `"stream": false`). Requests map
into the one request type (`disagg_agents.wire.request`) through `Client.generate`; the
response's durations (ns) and counts come from the agents' metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from disagg.api import Chunk, Client, Completion
from disagg.errors import DisaggError, Overloaded, UsageError
from disagg.frontends import core, maxtokens, tenancy
from disagg.frontends.agentinfo import About, ModelInfo
from disagg.frontends.apirequest import build
from disagg.frontends.guard import cache_salt
from disagg.frontends.ollama.modelinfo import (
    listed,
    resolve,
    running,
    show_model,
    timestamp,
)
from disagg.frontends.ollama.types import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ChatBody,
    CommonFields,
    GenerateBody,
    OllamaError,
    Options,
    ShowBody,
)
from disagg.frontends.refusal import ApiError
from disagg.serving import verdict
from disagg_agents.wire.answer import ToolCall
from disagg_agents.wire.request import GenerateRequest

VERSION = "0.12.0"  # the Ollama API version whose shapes these are
NDJSON = "application/x-ndjson"


def _ns(seconds: Any) -> int:
    return int(float(seconds) * 1e9) if isinstance(seconds, int | float) else 0


def _sampling(body: CommonFields) -> dict[str, Any]:
    o = body.options or Options()
    num_predict = o.num_predict
    return {
        "temperature": DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
        "top_p": DEFAULT_TOP_P if o.top_p is None else o.top_p,
        "seed": o.seed,
        "stop": o.stop,
        # num_predict < 0: until EOS (the decode agent caps it by the context); None:
        # the gateway's default (apirequest.build resolves it)
        "max_tokens": maxtokens.UNLIMITED
        if num_predict is not None and num_predict < 0
        else num_predict,
        # As sent: the request's one normalizer (GenerateRequest.normalize_format)
        # reads Ollama's "", "json" or schema; a schema is strict, as Ollama's grammar.
        "response_format": body.format,
        "think": body.think,
    }


def _request(body: CommonFields, inputs: dict[str, Any]) -> GenerateRequest:
    """The one request, built as every door builds it; a bad field is Ollama's 400."""
    try:
        return build(**_sampling(body), **inputs)
    except ApiError as e:
        raise OllamaError(e.status, e.message) from None


def generate_request(body: GenerateBody) -> GenerateRequest | None:
    """/api/generate's body as the one request; None for Ollama's "load the model"
    call (no prompt)."""
    if body.images:
        raise OllamaError(400, "images are not supported by disagg's text models")
    if not body.prompt and body.suffix is None:
        return None
    inputs = {"prompt": body.prompt or "", "raw": body.raw, "system": body.system}
    if body.suffix is not None:  # continue.dev's autocomplete: the PSM prompt, as is
        inputs.update(suffix=body.suffix, raw=True)
    return _request(body, inputs)


def chat_request(body: ChatBody) -> GenerateRequest | None:
    """/api/chat's body as the one request; None without messages (a load call)."""
    if any(m.images for m in body.messages):
        raise OllamaError(400, "images are not supported by disagg's text models")
    if not body.messages:
        return None
    inputs: dict[str, Any] = {"messages": [m.as_request() for m in body.messages]}
    if body.tools:
        inputs["tools"] = body.tools
    return _request(body, inputs)


def refuse_tools(model: str, about: About) -> None:
    """Ollama refuses `tools` for a model whose template has no tool markup; so do
    we, naming what Ollama's API can do instead (it has no tool_choice)."""
    caps = about.status.chat.capabilities if about.status.chat else None
    if caps is not None and "tools" not in caps:
        raise OllamaError(
            400,
            f"{model} does not support tools (its chat template has no tool markup): send "
            'the request without tools, or ask for the arguments as JSON with "format" '
            "(a JSON schema)",
        )


def _durations(c: Completion, t0: float) -> dict[str, Any]:
    m = c.metrics
    return {
        "total_duration": _ns(time.perf_counter() - t0),
        "load_duration": 0,  # agents keep their model loaded
        "prompt_eval_count": int(m.prompt_tokens or 0),
        "prompt_eval_duration": _ns(m.ttft),
        "eval_count": int(m.completion_tokens or 0),
        "eval_duration": _ns(m.decode_time),
    }


def routes(client: Client, workers: Executor | None = None) -> APIRouter:
    """Ollama's endpoints, for `disagg.frontends.app.create_app` to mount; requests run on
    `workers` (the gateway's, which may refuse: 503 with Retry-After)."""
    api = APIRouter()
    info = ModelInfo(client)

    async def describe(name: str) -> About:
        return await asyncio.to_thread(info.get, name)

    @api.get("/", response_class=PlainTextResponse)
    @api.head("/", response_class=PlainTextResponse)
    async def alive() -> str:
        return "Ollama is running"  # what Ollama answers; clients probe it

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [listed(name, await describe(name)) for name in client.models()]}

    @api.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [running(name, await describe(name)) for name in client.models()]}

    @api.post("/api/show")
    async def show(body: ShowBody) -> dict[str, Any]:
        name = resolve(client, body.model or body.name or "")
        return show_model(name, await describe(name))

    @api.post("/api/generate", response_model=None)
    async def generate(request: Request, body: GenerateBody) -> Any:
        return await answer(client, workers, request, body, generate_request(body), "generate")

    @api.post("/api/chat", response_model=None)
    async def chat(request: Request, body: ChatBody) -> Any:
        if body.tools:
            refuse_tools(body.model, await describe(resolve(client, body.model)))
        return await answer(client, workers, request, body, chat_request(body), "chat")

    @api.api_route("/api/{what}", methods=["POST", "DELETE", "PUT"], include_in_schema=False)
    async def unsupported(what: str) -> Response:
        raise OllamaError(
            501 if what in ("pull", "push", "create", "copy", "delete") else 404,
            f"/api/{what} is not served by disagg: models are the inventory's pipelines",
        )

    return api


async def answer(
    client: Client,
    workers: Executor | None,
    request: Request,
    body: CommonFields,
    req: GenerateRequest | None,
    kind: str,
) -> Any:
    """One request's answer: the whole of it, its NDJSON stream, or a load call's."""
    name = resolve(client, body.model)
    if req is not None:  # each API key its own prefix-cache tenant
        req = req.replace(cache_salt=cache_salt(request))
    t0 = time.perf_counter()
    head = {"model": body.model}
    if req is None:  # no prompt or messages: Ollama's "load the model" request
        # keep_alive 0 asks to unload: Ollama answers "unload" (agents stay loaded here)
        unload = body.keep_alive in (0, "0", "0s", "0m")
        done = {
            "created_at": timestamp(),
            "done": True,
            "done_reason": "unload" if unload else "load",
        }
        return {**head, **({"response": ""} if kind == "generate" else _msg("")), **done}
    try:
        result = await core.start(client, workers, request, name, req, body.stream)
    except UsageError as e:
        raise OllamaError(400, str(e)) from None
    except Overloaded as e:  # Ollama answers 503 when its queue is full
        raise OllamaError(503, str(e), {"Retry-After": str(e.retry_after_s)}) from None
    except DisaggError as e:
        raise OllamaError(500, str(e)) from None
    if isinstance(result, Completion):
        if body.think is False:  # as Ollama: no thinking when it was turned off
            result.reasoning = ""
        return verdict.whole(_final(head, kind, result, t0, whole=True), result)
    chunks, cancel = result
    return verdict.streamed(
        lambda seen: _ndjson(head, kind, seen, t0, cancel, body.think is not False),
        chunks,
        media_type=NDJSON,
        status_code=200,
    )


def _msg(text: str, thinking: str = "", calls: list[ToolCall] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:  # Ollama's shape: arguments as an object
        message["tool_calls"] = [
            {"function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return {"message": message}


def _piece(kind: str, text: str, thinking: str = "") -> dict[str, Any]:
    if kind == "chat":
        return _msg(text, thinking)
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def _final(
    head: dict[str, Any], kind: str, c: Completion, t0: float, whole: bool
) -> dict[str, Any]:
    """The last object: the whole answer (`whole`, not streaming) or an empty piece."""
    if not whole:
        piece = _piece(kind, "")
    elif kind == "chat":
        piece = _msg(c.text, c.reasoning, c.tool_calls)
    else:
        piece = _piece(kind, c.text, c.reasoning)
    return {
        **head,
        "created_at": timestamp(),
        **piece,
        "done": True,
        # Ollama says "stop" after a tool call too; the calls themselves tell.
        "done_reason": "stop" if c.finish_reason == "tool_calls" else c.finish_reason,
        **_durations(c, t0),
    }


async def _ndjson(
    head: dict[str, Any],
    kind: str,
    chunks: AsyncIterator[Chunk],
    t0: float,
    cancel: threading.Event,
    thinking: bool = True,
) -> AsyncIterator[str]:
    def line(obj: dict[str, Any]) -> str:
        return json.dumps(obj) + "\n"

    try:
        async for chunk in chunks:
            if chunk.text or (chunk.reasoning and thinking):
                piece = _piece(kind, chunk.text, chunk.reasoning if thinking else "")
                yield line({**head, "created_at": timestamp(), **piece, "done": False})
            if chunk.done and chunk.completion is not None:
                c = chunk.completion
                if c.tool_calls and kind == "chat":  # as Ollama streams them: before done
                    calls = _msg("", "", c.tool_calls)
                    yield line({**head, "created_at": timestamp(), **calls, "done": False})
                yield line(_final(head, kind, c, t0, whole=False))
    except DisaggError as e:
        text = str(e) if tenancy.operator_now() else tenancy.for_tenant(str(e))
        yield line({"error": text})  # the ollama client raises ResponseError on it
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding

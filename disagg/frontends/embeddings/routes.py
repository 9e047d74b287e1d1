"""Embedding routes over a disagg Client: the vectors come from the model's prefill
agent (`disagg.serving.embed`), L2-normalized, re-normalized after a `dimensions` cut."""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import threading
import time
from concurrent.futures import Executor
from typing import Any

from fastapi import APIRouter, Request

from disagg.api import Client
from disagg.errors import DisaggError
from disagg.frontends import core
from disagg.frontends.embeddings.types import OllamaEmbed, OllamaEmbeddings, OpenAIEmbeddings
from disagg.frontends.guard import unless_gone
from disagg.frontends.refusal import ApiError, PlainError
from disagg.serving.embed import Embeddings, embed


async def _embed(
    client: Client,
    workers: Executor | None,
    request: Request,
    model: str,
    texts: list[str],
    **kw: Any,
) -> Embeddings:
    """The vectors, computed on a worker; a client that hangs up stops the prefill
    agent before its next decoder layer (64 long texts hung up after 5 s once kept
    it busy for over a minute, one 8k-token input 54 s)."""

    async def run(cancel: threading.Event) -> Embeddings:
        work = functools.partial(embed, client.router, model, texts, cancel=cancel, **kw)
        return await asyncio.get_running_loop().run_in_executor(workers, work)

    result: Embeddings = await unless_gone(request, run)
    return result


def _ollama(e: DisaggError) -> PlainError:
    err = core.from_disagg(e)
    return PlainError(err.status, err.message, err.headers)


def routes(client: Client, workers: Executor | None = None) -> APIRouter:
    """Ollama's two embedding endpoints and OpenAI's, for the app to mount."""
    api = APIRouter()
    _ollama_routes(api, client, workers)

    @api.post("/v1/embeddings")
    async def openai_embeddings(request: Request, body: OpenAIEmbeddings) -> dict[str, Any]:
        core.check_model(client, body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or not all(isinstance(t, str) for t in texts):
            msg = "input must be text or a list of texts (token ids are not taken)"
            raise ApiError(400, msg, "invalid_request_error", "input")
        try:
            e = await _embed(
                client,
                workers,
                request,
                body.model,
                [str(t) for t in texts],
                truncate=False,  # OpenAI refuses an input over the model's limit: a 400
                dimensions=body.dimensions,
            )
        except DisaggError as err:
            raise core.from_disagg(err) from None
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(e.vectors)
        ]
        usage = {"prompt_tokens": e.prompt_tokens, "total_tokens": e.prompt_tokens}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    return api


def _ollama_routes(api: APIRouter, client: Client, workers: Executor | None) -> None:
    @api.post("/api/embed")
    async def ollama_embed(request: Request, body: OllamaEmbed) -> dict[str, Any]:
        t0 = time.perf_counter_ns()
        if body.model.removesuffix(":latest") not in client.models():
            raise PlainError(404, f"model '{body.model}' not found")
        try:
            e = await _embed(
                client,
                workers,
                request,
                body.model.removesuffix(":latest"),
                body.texts(),
                truncate=body.truncate,
                max_tokens=body.max_tokens(),
                dimensions=body.dimensions,
            )
        except DisaggError as err:
            raise _ollama(err) from None
        return {
            "model": body.model,
            "embeddings": e.vectors,
            "total_duration": time.perf_counter_ns() - t0,
            "load_duration": 0,
            "prompt_eval_count": e.prompt_tokens,
        }

    @api.post("/api/embeddings")
    async def ollama_embeddings(request: Request, body: OllamaEmbeddings) -> dict[str, Any]:
        if body.model.removesuffix(":latest") not in client.models():
            raise PlainError(404, f"model '{body.model}' not found")
        try:
            model = body.model.removesuffix(":latest")
            e = await _embed(client, workers, request, model, [body.prompt])
        except DisaggError as err:
            raise _ollama(err) from None
        return {"embedding": e.vectors[0]}


def _encoded(v: list[float], fmt: str) -> list[float] | str:
    """float, or base64 of little-endian float32 (what the openai SDK asks for by default)."""
    if fmt == "float":
        return v
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()

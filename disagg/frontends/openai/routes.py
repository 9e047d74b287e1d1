"""OpenAI's API over a disagg Client: GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, with and without SSE streaming; errors in OpenAI's
shape with 4xx/5xx codes (disagg.frontends.core's refusals). The bodies are
`disagg.frontends.openai.types`; the app
(`disagg.frontends.app`) mounts these routes beside Ollama's and the guard.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from fastapi import APIRouter, Request

from disagg.api import Chunk, Client, Completion
from disagg.errors import DisaggError
from disagg.frontends import core
from disagg.frontends.core import Usage
from disagg.frontends.guard import cache_salt, wants_internals
from disagg.frontends.openai.types import (
    ChatRequest,
    CommonFields,
    CompletionRequest,
    chat_request,
    common_request,
)
from disagg.serving import verdict
from disagg.serving.metrics import public_metrics
from disagg_agents.wire.request import GenerateRequest


def _usage(c: Completion) -> dict[str, Any]:
    u = Usage.of(c)
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        # OpenAI's field: prompt tokens whose K/V came from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        # OpenAI's names for predicted outputs; here the drafts come from the prompt.
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_draft_tokens,
            "rejected_prediction_tokens": u.draft_tokens - u.accepted_draft_tokens,
        },
        "disagg_verdict": u.verdict,  # which path ran (the header's)
    }


def completion_request(body: CompletionRequest) -> GenerateRequest:
    """/v1/completions' body as the one request: the prompt as is, no chat template;
    with `suffix`, fill-in-the-middle where the model's tokenizer has FIM tokens."""
    return common_request(body, {"prompt": body.prompt, "raw": True, "suffix": body.suffix})


def tool_calls(c: Completion) -> list[dict[str, Any]]:
    """The model's calls in OpenAI's shape: arguments as a JSON string."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            # as the model wrote them where it wrote JSON: sent back, they render byte-exact
            "function": {"name": call.name, "arguments": call.arguments_json},
        }
        for call in c.tool_calls
    ]


def routes(client: Client, workers: Executor | None = None) -> APIRouter:
    """OpenAI's endpoints, for `disagg.frontends.app.create_app` to mount; requests
    run on `workers` (the app's, which may refuse: 429 with Retry-After)."""
    api = APIRouter()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "disagg"}
                for m in client.models()
            ],
        }

    @api.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request, body: ChatRequest) -> Any:
        return await answer(client, workers, request, body, chat_request(body), "chat")

    @api.post("/v1/completions", response_model=None)
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await answer(client, workers, request, body, completion_request(body), "text")

    return api


async def answer(
    client: Client,
    workers: Executor | None,
    request: Request,
    body: CommonFields,
    req: GenerateRequest,
    kind: str,
) -> Any:
    """One request's answer: the whole completion, or its SSE stream."""
    core.check_model(client, body.model)
    req = req.replace(cache_salt=cache_salt(request, body.cache_salt))
    internals = wants_internals(request)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    try:
        result = await core.start(client, workers, request, body.model, req, body.stream)
    except DisaggError as e:
        raise core.from_disagg(e) from None
    if isinstance(result, Completion):
        return verdict.whole(_full(kind, rid, created, result, internals), result)
    chunks, cancel = result
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return verdict.streamed(
        lambda seen: _sse(kind, rid, created, body.model, seen, usage, cancel),
        chunks,
        media_type="text/event-stream",
    )


def _full(kind: str, rid: str, created: int, c: Completion, internals: bool) -> dict[str, Any]:
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.reasoning:
            # vLLM renamed reasoning_content to reasoning; clients read one or the other
            message["reasoning_content"] = message["reasoning"] = c.reasoning
        if c.tool_calls:
            message.update(tool_calls=tool_calls(c), content=c.text or None)
        choice: dict[str, Any] = {"index": 0, "finish_reason": c.finish_reason, "message": message}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "finish_reason": c.finish_reason, "text": c.text, "logprobs": None}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": c.model,
        "choices": [choice],
        "usage": _usage(c),
        "disagg_metrics": c.metrics.to_json() if internals else public_metrics(c.metrics),
    }


async def _sse(
    kind: str,
    rid: str,
    created: int,
    model: str,
    chunks: AsyncIterator[Chunk],
    include_usage: bool,
    cancel: threading.Event,
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def event(choice: dict[str, Any], **extra: Any) -> str:
        body = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice] if choice else [],
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    def piece(text: str, finish: str | None = None) -> dict[str, Any]:
        if kind == "chat":
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

    if kind == "chat":
        yield event(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        )
    try:
        async for chunk in chunks:
            if chunk.reasoning and kind == "chat":
                thought: dict[str, Any] = {
                    "reasoning_content": chunk.reasoning,
                    "reasoning": chunk.reasoning,
                }
                yield event({"index": 0, "delta": thought, "finish_reason": None})
            if chunk.text:
                yield event(piece(chunk.text))
            if chunk.done and chunk.completion is not None:
                calls = tool_calls(chunk.completion) if kind == "chat" else []
                for i, call in enumerate(calls):  # each call whole, in one delta
                    called: dict[str, Any] = {"tool_calls": [{"index": i, **call}]}
                    yield event({"index": 0, "delta": called, "finish_reason": None})
                yield event(piece("", chunk.completion.finish_reason))
                if include_usage:
                    yield event({}, usage=_usage(chunk.completion))
    except DisaggError as e:
        yield f"data: {json.dumps(core.from_disagg(e).body())}\n\n"
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding
    yield "data: [DONE]\n\n"

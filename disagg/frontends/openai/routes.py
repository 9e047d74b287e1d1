"""OpenAI's API over a disagg Client: GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, with and without SSE streaming; errors in OpenAI's
shape with 4xx/5xx codes. The bodies are `disagg.frontends.openai.types`; the app
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
from disagg.errors import AgentError, DisaggError, ModelMismatch, Overloaded, UsageError
from disagg.frontends import maxtokens, tenancy
from disagg.frontends.guard import cache_salt, unless_gone, wants_internals
from disagg.frontends.openai.types import (
    ChatRequest,
    CommonFields,
    CompletionRequest,
    OpenAIError,
)
from disagg.frontends.streamstart import opened
from disagg.serving import verdict
from disagg.serving.metrics import public_metrics
from disagg.serving.request import build_request
from disagg_agents.wire.request import GenerateRequest


def from_disagg(e: DisaggError) -> OpenAIError:
    if isinstance(e, AgentError) and not tenancy.operator_now():
        # Agents' addresses are the operator's to see (a stream's error event too).
        e = type(e)(tenancy.hide_addresses(str(e)))
    if isinstance(e, Overloaded):  # OpenAI's clients retry a 429 after Retry-After
        retry = {"Retry-After": str(e.retry_after_s)}
        return OpenAIError(429, str(e), "requests", code="rate_limit_exceeded", headers=retry)
    if isinstance(e, UsageError):
        return OpenAIError(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, ModelMismatch):
        return OpenAIError(502, str(e), "server_error", code="model_mismatch")
    if isinstance(e, AgentError):
        return OpenAIError(503, str(e), "server_error", code="agent_unavailable")
    return OpenAIError(500, str(e), "server_error")


def _usage(c: Completion) -> dict[str, Any]:
    prompt = int(c.metrics.prompt_tokens or 0)
    completion = int(c.metrics.completion_tokens or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's field: prompt tokens whose K/V came from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": int(c.metrics.cached_tokens or 0)},
        "disagg_verdict": verdict.verdict(c.metrics),  # which path ran (the header's)
    }


def _request(body: CommonFields, inputs: dict[str, Any]) -> GenerateRequest:
    asked = [getattr(body, "max_completion_tokens", None), body.max_tokens]
    try:
        return build_request(
            max_tokens=maxtokens.resolve(next((n for n in asked if n is not None), None)),
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop,
            seed=body.seed,
            placement=body.placement,
            **inputs,
        )
    except UsageError as e:
        raise from_disagg(e) from None


def chat_request(body: ChatRequest) -> GenerateRequest:
    """/v1/chat/completions' body as the one request."""
    inputs: dict[str, Any] = {"messages": [m.as_request() for m in body.messages]}
    if body.tools:
        inputs.update(tools=body.tools, tool_choice=body.tool_choice)
    elif body.tool_choice not in (None, "none", "auto"):
        raise OpenAIError(
            400,
            "tool_choice names a tool, but no tools were given",
            "invalid_request_error",
            "tool_choice",
        )
    # As sent: the request's one normalizer (GenerateRequest.normalize_format) reads
    # OpenAI's shape; a bad one is a 400 naming response_format.
    inputs["response_format"] = body.response_format
    inputs["think"] = body.reasoning_effort
    return _request(body, inputs)


def completion_request(body: CompletionRequest) -> GenerateRequest:
    """/v1/completions' body as the one request: the prompt as is, no chat template;
    with `suffix`, fill-in-the-middle where the model's tokenizer has FIM tokens."""
    return _request(body, {"prompt": body.prompt, "raw": True, "suffix": body.suffix})


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


def check_model(client: Client, name: str) -> None:
    if name not in client.models():
        raise OpenAIError(
            404,
            f"The model '{name}' does not exist",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


async def start(
    client: Client,
    workers: Executor | None,
    request: Request,
    model: str,
    req: GenerateRequest,
    stream: bool,
) -> Completion | tuple[AsyncIterator[Chunk], threading.Event]:
    """Run `req` for any front door: the whole completion (given up when the client
    hangs up), or the stream's chunks and the event that stops its decoding.
    Raises DisaggError; the caller puts it in its API's shape."""
    if not stream:
        return await unless_gone(
            request,
            lambda cancel: client.agenerate(req, model=model, cancel=cancel, executor=workers),
        )
    cancel = threading.Event()
    chunks = await client.agenerate(req, model=model, stream=True, cancel=cancel, executor=workers)
    assert not isinstance(chunks, Completion)
    try:
        return await opened(chunks), cancel  # a refusal is raised before the stream opens
    except BaseException:
        cancel.set()
        raise


async def answer(
    client: Client,
    workers: Executor | None,
    request: Request,
    body: CommonFields,
    req: GenerateRequest,
    kind: str,
) -> Any:
    """One request's answer: the whole completion, or its SSE stream."""
    check_model(client, body.model)
    req = req.replace(cache_salt=cache_salt(request, body.cache_salt))
    internals = wants_internals(request)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    try:
        result = await start(client, workers, request, body.model, req, body.stream)
    except DisaggError as e:
        raise from_disagg(e) from None
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
        yield f"data: {json.dumps(from_disagg(e).body())}\n\n"
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding
    yield "data: [DONE]\n\n"

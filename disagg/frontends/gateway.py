"""OpenAI-compatible HTTP gateway over a disagg Client (FastAPI).

GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with and
without SSE streaming; errors in OpenAI's shape with 4xx/5xx codes. Ollama's
API shares the port (`disagg.frontends.ollama`); `disagg.frontends.guard` checks
the API key and caps bodies for both.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from agents.wire.request import GenerateRequest
from disagg.api import Chunk, Client, Completion
from disagg.errors import AgentError, DisaggError, ModelMismatch, Overloaded, UsageError
from disagg.frontends import ollama, webview
from disagg.frontends.guard import (
    MAX_BODY_BYTES,
    Guard,
    cache_salt,
    unless_gone,
    wants_internals,
)
from disagg.frontends.workers import Workers
from disagg.serving.metrics import public_metrics
from disagg.serving.request import build_request


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # Text, or OpenAI's content parts ({"type": "text", "text": ...}); None on a tool call.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, as we return it

    def as_request(self) -> dict[str, Any]:
        """This message as the one request type takes it."""
        out: dict[str, Any] = {"role": self.role, "content": _text(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
            out["content"] = out["content"] or None
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(
                400,
                f"content part of type {part.get('type')!r}: disagg's models take text only",
                "invalid_request_error",
                "messages",
            )
    return "".join(part["text"] for part in content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model: str
    # Limits are checked once, by agents.wire.request (a 400 naming the field).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    # vLLM's: requests passing the same salt share cached prompt K/V (default: per API key).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted: calls are parsed as the model makes them
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class CompletionRequest(_Common):
    prompt: str
    suffix: str | None = None  # fill-in-the-middle: the text after the completion


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _from_disagg(e: DisaggError) -> OpenAIError:
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
    prompt = int(c.metrics.get("prompt_tokens") or 0)
    completion = int(c.metrics.get("completion_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's field: prompt tokens whose K/V came from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": int(c.metrics.get("cached_tokens") or 0)},
    }


def _request(body: _Common, inputs: dict[str, Any]) -> GenerateRequest:
    asked = [getattr(body, "max_completion_tokens", None), body.max_tokens]
    try:
        return build_request(
            max_tokens=next((n for n in asked if n is not None), 256),
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop,
            seed=body.seed,
            **inputs,
        )
    except UsageError as e:
        raise _from_disagg(e) from None


def response_format(rf: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as the request's: json_object, or json_schema with
    the schema itself (OpenAI nests it under json_schema.schema)."""
    if rf is None or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return {"type": "json_object"}
    if rf.get("type") == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError(
                400,
                "response_format.json_schema.schema must be a JSON Schema object",
                "invalid_request_error",
                "response_format",
            )
        return {"type": "json_schema", "schema": spec["schema"], "strict": bool(spec.get("strict"))}
    raise OpenAIError(
        400,
        f"response_format type {rf.get('type')!r}: use text, json_object or json_schema",
        "invalid_request_error",
        "response_format",
    )


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
    inputs["response_format"] = response_format(body.response_format)
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
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in c.tool_calls
    ]


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
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    pool = workers or Workers.for_router(client.router)
    app.include_router(ollama.routes(client, pool))
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    # /ui, /ui/api/..., /metrics; the web view's sign-in takes the first key.
    app.include_router(webview.routes(client, keys[0] if keys else None))

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ollama.OllamaError)
    async def _ollama_error(_: Request, e: ollama.OllamaError) -> JSONResponse:
        return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        if not request.url.path.startswith("/v1"):
            return JSONResponse({"error": msg}, status_code=400)
        err = OpenAIError(400, msg, "invalid_request_error", ".".join(loc) or None)
        return JSONResponse(err.body(), status_code=400)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "disagg"}
                for m in client.models()
            ],
        }

    def check_model(name: str) -> None:
        if name not in client.models():
            raise OpenAIError(
                404,
                f"The model '{name}' does not exist",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    async def run(request: Request, body: _Common, req: GenerateRequest, kind: str) -> Any:
        check_model(body.model)
        req = req.replace(cache_salt=cache_salt(request, body.cache_salt))
        internals = wants_internals(request)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            if not body.stream:
                result = await unless_gone(
                    request,
                    lambda cancel: client.agenerate(
                        req, model=body.model, cancel=cancel, executor=pool
                    ),
                )
                return _full(kind, rid, created, result, internals)
            cancel = threading.Event()
            chunks = await client.agenerate(
                req, model=body.model, stream=True, cancel=cancel, executor=pool
            )
        except DisaggError as e:
            raise _from_disagg(e) from None
        assert not isinstance(chunks, Completion)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(kind, rid, created, body.model, chunks, usage, cancel),
            media_type="text/event-stream",
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request, body: ChatRequest) -> Any:
        return await run(request, body, chat_request(body), "chat")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await run(request, body, completion_request(body), "text")

    return app


def _full(kind: str, rid: str, created: int, c: Completion, internals: bool) -> dict[str, Any]:
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.reasoning:
            message["reasoning_content"] = c.reasoning
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
        "disagg_metrics": c.metrics.to_dict() if internals else public_metrics(c.metrics),
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
                thought: dict[str, Any] = {"reasoning_content": chunk.reasoning}
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
        yield f"data: {json.dumps(_from_disagg(e).body())}\n\n"
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding
    yield "data: [DONE]\n\n"

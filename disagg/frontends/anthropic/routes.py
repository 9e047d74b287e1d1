"""Anthropic's Messages API over a disagg Client: POST /v1/messages (whole or as
Anthropic's SSE events) and /v1/messages/count_tokens. The body maps straight onto
the one GenerateRequest (`types.generate_request`); the run, refusals and usage are
disagg.frontends.core's."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from fastapi import APIRouter, Request

from disagg.api import Chunk, Client, Completion
from disagg.errors import DisaggError
from disagg.frontends import core
from disagg.frontends.agentinfo import ModelInfo
from disagg.frontends.anthropic.types import (
    AnthropicError,
    CountTokensRequest,
    MessagesRequest,
    generate_request,
)
from disagg.frontends.core import Usage
from disagg.frontends.guard import cache_salt
from disagg.frontends.refusal import ApiError
from disagg.serving import verdict
from disagg_agents.wire.request import GenerateRequest


def from_api_error(e: ApiError) -> AnthropicError:
    status = 529 if e.status == 503 else e.status  # Anthropic's "overloaded"
    return AnthropicError(status, e.message, e.headers)


def usage(c: Completion) -> dict[str, Any]:
    """Anthropic counts cache reads apart from the input tokens it processed."""
    u = Usage.of(c)
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "disagg_verdict": u.verdict,  # which path ran (the header's)
    }


def stop_reason(c: Completion) -> str:
    if c.tool_calls:
        return "tool_use"
    if c.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if c.finish_reason == "length" else "end_turn"


def tool_uses(c: Completion) -> list[dict[str, Any]]:
    return [
        {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "input": call.arguments,
        }
        for call in c.tool_calls
    ]


def message(rid: str, model: str, content: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        **rest,
    }


def full(rid: str, c: Completion) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if c.reasoning:
        content.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    if c.text or not c.tool_calls:
        content.append({"type": "text", "text": c.text})
    content += tool_uses(c)
    return message(
        rid,
        c.model,
        content,
        stop_reason=stop_reason(c),
        stop_sequence=c.stop_sequence,
        usage=usage(c),
    )


def request_of(request: Request, body: MessagesRequest) -> GenerateRequest:
    """The Messages body as the one request, salted for the caller's prefix cache."""
    return generate_request(body).replace(cache_salt=cache_salt(request))


def routes(client: Client, workers: Executor | None = None) -> APIRouter:
    """Anthropic's endpoints, for `disagg.frontends.app.create_app` to mount."""
    api = APIRouter()
    info = ModelInfo(client)

    async def reasons(model: str) -> bool:
        """Whether the model reasons apart (unknown: assume it does; the agent decides)."""
        chat = (await asyncio.to_thread(info.get, model)).status.chat
        return chat is None or chat.reasoning is not False

    @api.post("/v1/messages", response_model=None)
    async def messages(request: Request, body: MessagesRequest) -> Any:
        _check_model(client, body.model)
        req = request_of(request, body)
        if req.think not in (None, False) and not await reasons(body.model):
            # Claude Code asks every model for thinking (adaptive, effort high); one
            # that does not reason answers without it rather than refusing the turn.
            req = req.replace(think=None)
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        try:
            result = await core.start(client, workers, request, body.model, req, body.stream)
        except DisaggError as e:
            raise from_api_error(core.from_disagg(e)) from None
        if isinstance(result, Completion):
            return verdict.whole(full(rid, result), result)
        chunks, cancel = result
        return verdict.streamed(
            lambda seen: events(rid, body.model, seen, cancel),
            chunks,
            media_type="text/event-stream",
        )

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request, body: CountTokensRequest) -> dict[str, int]:
        # The prompt as the model's template renders it, counted by a one-token run
        # (which also warms the prefix cache for the request that follows).
        _check_model(client, body.model)
        whole = MessagesRequest(**body.model_dump(exclude_none=True), max_tokens=1)
        req = request_of(request, whole)
        try:
            result = await core.start(client, workers, request, body.model, req, False)
        except DisaggError as e:
            raise from_api_error(core.from_disagg(e)) from None
        assert isinstance(result, Completion)
        return {"input_tokens": int(result.metrics.prompt_tokens or 0)}

    return api


def _check_model(client: Client, name: str) -> None:
    if name not in client.models():
        raise AnthropicError(404, f"model: {name}")


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class _Blocks:
    """The content blocks of a streamed message: one open at a time, indexed in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def to(self, kind: str, block: dict[str, Any]) -> list[str]:
        """Events that leave the open block (if another kind) and open `block`."""
        if self.open == kind:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


async def events(
    rid: str, model: str, chunks: AsyncIterator[Chunk], cancel: threading.Event
) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, each block's start/deltas/stop (thinking,
    text, then each tool_use whole), message_delta with the stop reason and usage,
    message_stop."""
    zero = {"input_tokens": 0, "output_tokens": 0}
    yield _event("message_start", {"message": message(rid, model, [], usage=zero)})
    blocks = _Blocks()
    try:
        async for chunk in chunks:
            if chunk.reasoning:
                for e in blocks.to(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                ):
                    yield e
                yield blocks.delta({"type": "thinking_delta", "thinking": chunk.reasoning})
            if chunk.text:
                for e in blocks.to("text", {"type": "text", "text": ""}):
                    yield e
                yield blocks.delta({"type": "text_delta", "text": chunk.text})
            if chunk.done and chunk.completion is not None:
                for e in _finish(blocks, chunk.completion):
                    yield e
    except DisaggError as e:
        err = from_api_error(core.from_disagg(e))
        yield _event("error", {"error": err.body()["error"]})
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding


def _finish(blocks: _Blocks, c: Completion) -> list[str]:
    out = []
    if blocks.open == "thinking":  # the SDK keeps a signature per thinking block
        out.append(blocks.delta({"type": "signature_delta", "signature": ""}))
    if blocks.index < 0 and not c.tool_calls:
        out += blocks.to("text", {"type": "text", "text": ""})
    for use in tool_uses(c):
        out += blocks.close()
        out += blocks.to(use["id"], {**use, "input": {}})
        args = json.dumps(use["input"])
        out.append(blocks.delta({"type": "input_json_delta", "partial_json": args}))
    out += blocks.close()
    delta = {"stop_reason": stop_reason(c), "stop_sequence": c.stop_sequence}
    out.append(_event("message_delta", {"delta": delta, "usage": usage(c)}))
    out.append(_event("message_stop", {}))
    return out

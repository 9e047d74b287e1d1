"""OpenAI's Responses API over a disagg Client: POST /v1/responses, whole or as the
SSE events the official SDK types (response.created ... response.completed). The
body maps straight onto the one GenerateRequest (`types.request_fields`, then
disagg.frontends.apirequest's `build`); the run, refusals and usage are
disagg.frontends.core's; a forced custom tool's input follows its Lark grammar,
through the grammar engine on the decode agent."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from fastapi import APIRouter, Request

from disagg.api import Chunk, Client, Completion
from disagg.errors import DisaggError, UsageError
from disagg.frontends import core
from disagg.frontends.apirequest import build
from disagg.frontends.core import Usage
from disagg.frontends.guard import cache_salt
from disagg.frontends.refusal import ApiError
from disagg.frontends.responses.types import (
    ResponsesRequest,
    compile_error,
    forced_custom,
    grammar_of,
    request_fields,
)
from disagg.serving import verdict
from disagg.serving.checkedrequest import with_fields
from disagg_agents.wire.request import GenerateRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Answer:
    """One response: its request's echo and the output items built from a completion."""

    def __init__(self, body: ResponsesRequest) -> None:
        # Bad input: a 400 before any agent runs. The request's own limits are
        # checked in `request`, after the custom tools' grammars compile.
        self.fields, self.custom = request_fields(body)
        self.body = body
        self.forced = forced_custom(body, self.custom)
        self.id, self.created = _id("resp"), int(time.time())

    def request(self, request: Request) -> GenerateRequest:
        req = build(**self.fields)
        salt = cache_salt(request, self.body.cache_salt)
        try:
            if self.forced is not None:
                # The whole answer is the tool's input, under its grammar (or free).
                grammar = grammar_of(self.custom[self.forced])
                return with_fields(req, tool_choice=None, response_format=grammar, cache_salt=salt)
            return with_fields(req, cache_salt=salt)
        except UsageError as e:
            raise core.from_disagg(e) from None

    def envelope(self, status: str, output: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": b.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": False,
            "temperature": b.temperature,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "top_p": b.top_p,
            "truncation": b.truncation or "disabled",
            "usage": None,
            "metadata": b.metadata or {},
            **rest,
        }

    def reasoning_item(self, text: str, rid: str) -> dict[str, Any]:
        item: dict[str, Any] = {
            "type": "reasoning",
            "id": rid,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }
        if self.body.wants_encrypted_reasoning():
            item["encrypted_content"] = text  # plain text: it comes back in the next input
        return item

    def calls(self, c: Completion) -> list[dict[str, Any]]:
        if self.forced is not None:
            return [self.custom_call(self.forced, c.text)]
        out = []
        for call in c.tool_calls:
            if call.name in self.custom:
                out.append(self.custom_call(call.name, str(call.arguments.get("input", ""))))
                continue
            out.append(
                {
                    "type": "function_call",
                    "id": _id("fc"),
                    "call_id": _id("call"),
                    "name": call.name,
                    "arguments": call.arguments_json,
                    "status": "completed",
                }
            )
        return out

    def custom_call(self, name: str, text: str) -> dict[str, Any]:
        return {
            "type": "custom_tool_call",
            "id": _id("ctc"),
            "call_id": _id("call"),
            "name": name,
            "input": text,
            "status": "completed",
        }

    def done(self, c: Completion, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response: completed, or incomplete at max_output_tokens."""
        u = Usage.of(c)
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "disagg_verdict": u.verdict,  # which path ran (the header's)
        }
        if c.finish_reason == "length":
            return self.envelope(
                "incomplete",
                output,
                usage=usage,
                incomplete_details={"reason": "max_output_tokens"},
            )
        return self.envelope("completed", output, usage=usage)


def message_item(text: str, mid: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": mid,
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def full(a: Answer, c: Completion) -> dict[str, Any]:
    output = []
    if c.reasoning:
        output.append(a.reasoning_item(c.reasoning, _id("rs")))
    calls = a.calls(c)
    if c.text and a.forced is None:
        output.append(message_item(c.text, _id("msg")))
    return a.done(c, output + calls if calls or output else [message_item("", _id("msg"))])


def routes(client: Client, workers: Executor | None = None) -> APIRouter:
    """The Responses endpoint, for `disagg.frontends.app.create_app` to mount."""
    api = APIRouter()

    @api.post("/v1/responses", response_model=None)
    async def responses(request: Request, body: ResponsesRequest) -> Any:
        core.check_model(client, body.model)
        a = Answer(body)
        if any(grammar_of(t) for t in a.custom.values()):
            await compiles(workers, a)
        req = a.request(request)
        try:
            result = await core.start(client, workers, request, body.model, req, body.stream)
        except DisaggError as e:
            raise core.from_disagg(e) from None
        if isinstance(result, Completion):
            return verdict.whole(full(a, result), result)
        chunks, cancel = result
        return verdict.streamed(
            lambda seen: events(a, seen, cancel), chunks, media_type="text/event-stream"
        )

    return api


async def compiles(workers: Executor | None, a: Answer) -> None:
    """The custom tools' grammars compiled in a child, on an admitted worker thread
    (the key's share counts it; the event loop goes on): a 400 if one does not."""
    try:
        error = await asyncio.get_running_loop().run_in_executor(workers, compile_error, a.custom)
    except DisaggError as e:  # Overloaded: this key holds its share
        raise core.from_disagg(e) from None
    if error is not None:
        raise error


class _Stream:
    """The SSE events of one response: numbered, each item opened and closed once."""

    def __init__(self, a: Answer) -> None:
        self.a, self.seq, self.output = a, 0, []  # type: ignore[var-annotated]
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.text = ""

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        body = {"type": kind, "sequence_number": self.seq - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def piece(self, kind: str, text: str) -> list[str]:
        """Text of `kind` (reasoning or message): opens its item first if need be."""
        out = [] if self.open is not None and self.open["type"] == kind else self.close()
        if self.open is None:
            if kind == "reasoning":
                item = {**self.a.reasoning_item("", _id("rs")), "content": []}
            else:
                item = message_item("", _id("msg"), "in_progress")
            self.open, self.text = item, ""
            out.append(self.added(item))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self.event("response.content_part.added", **self.at(), part=part))
        self.text += text
        delta = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(delta, **self.at(), delta=text, **extra))
        return out

    def at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def added(self, item: dict[str, Any]) -> str:
        return self.event("response.output_item.added", output_index=len(self.output), item=item)

    def finished(self, item: dict[str, Any]) -> str:
        out = self.event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        self.open = item  # for at()
        where = self.at()
        self.open = None
        if item["type"] == "reasoning":
            whole = self.a.reasoning_item(self.text, item["id"])
            done = self.event("response.reasoning_text.done", **where, text=self.text)
            return [done, self.finished(whole)]
        whole = message_item(self.text, item["id"])
        part = whole["content"][0]
        return [
            self.event("response.output_text.done", **where, text=self.text, logprobs=[]),
            self.event("response.content_part.done", **where, part=part),
            self.finished(whole),
        ]

    def call(self, item: dict[str, Any]) -> list[str]:
        """A tool call, whole: added, its arguments (or input) in one delta, done."""
        custom = item["type"] == "custom_tool_call"
        key = "input" if custom else "arguments"
        kind = "response.custom_tool_call_input" if custom else "response.function_call_arguments"
        where = {"item_id": item["id"], "output_index": len(self.output)}
        return [
            self.added({**item, key: "", "status": "in_progress"}),
            self.event(f"{kind}.delta", **where, delta=item[key]),
            self.event(f"{kind}.done", **where, **{key: item[key]}),
            self.finished(item),
        ]


async def events(
    a: Answer, chunks: AsyncIterator[Chunk], cancel: threading.Event
) -> AsyncIterator[str]:
    """response.created, in_progress, each output item's events, then
    response.completed (or .incomplete at max_output_tokens, .failed on an error)."""
    s = _Stream(a)
    start = a.envelope("in_progress", [])
    yield s.event("response.created", response=start)
    yield s.event("response.in_progress", response=start)
    try:
        async for chunk in chunks:
            if chunk.reasoning:
                for e in s.piece("reasoning", chunk.reasoning):
                    yield e
            if chunk.text and a.forced is None:
                for e in s.piece("message", chunk.text):
                    yield e
            if chunk.done and chunk.completion is not None:
                c = chunk.completion
                calls = a.calls(c)
                if s.open is None and not s.output and not calls:  # as full(): a message
                    for e in s.piece("message", ""):
                        yield e
                for e in s.close():
                    yield e
                for item in calls:
                    for e in s.call(item):
                        yield e
                final = a.done(c, s.output)
                yield s.event(f"response.{final['status']}", response=final)
    except DisaggError as e:
        err = core.from_disagg(e)
        failed = a.envelope("failed", s.output, error={"code": _code(err), "message": err.message})
        yield s.event("response.failed", response=failed)
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding


def _code(err: ApiError) -> str:
    """response.failed's error code: the client's mistake is no server_error."""
    if err.code:
        return err.code
    return "invalid_prompt" if err.status < 500 else "server_error"

"""What every front door shares over one Client: the run (start), the model
check, the refusal a DisaggError becomes, and the usage an answer counts.

Each API (disagg.frontends.<api>) maps its body straight to a GenerateRequest and
this module's results back to its own wire format; none imports another. A
refusal is an `ApiError` (disagg.frontends.refusal): OpenAI's three APIs answer
its body as is, the others build theirs from its status and message.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from disagg.api import Chunk, Client, Completion
from disagg.errors import AgentError, DisaggError, ModelMismatch, Overloaded, UsageError
from disagg.frontends import tenancy
from disagg.frontends.guard import DISCONNECT_POLL_S, tenant_tag, unless_gone
from disagg.frontends.refusal import ApiError
from disagg.frontends.streamstart import opened
from disagg.frontends.workers import Workers, charge, prompt_tokens
from disagg.serving import verdict
from disagg_agents.wire.promptsize import prompt_bytes
from disagg_agents.wire.request import GenerateRequest


def from_disagg(e: DisaggError) -> ApiError:
    """What a DisaggError tells the client: its status, kind and code. A tenant
    other than the operator reads our messages only: no agents' addresses (a
    stream's error event too), no exception text from the code's insides."""
    text = str(e) if tenancy.operator_now() else tenancy.for_tenant(str(e))
    if isinstance(e, Overloaded):  # OpenAI's clients retry a 429 after Retry-After
        retry = {"Retry-After": str(e.retry_after_s)}
        return ApiError(429, text, "requests", code="rate_limit_exceeded", headers=retry)
    if isinstance(e, UsageError):
        return ApiError(400, text, "invalid_request_error", e.param)
    if isinstance(e, ModelMismatch):
        return ApiError(502, text, "server_error", code="model_mismatch")
    if isinstance(e, AgentError):
        return ApiError(503, text, "server_error", code="agent_unavailable")
    if not tenancy.operator_now():
        text = f"the gateway could not answer this request: {text}"
    return ApiError(500, text, "server_error", code="internal_error")


def check_model(client: Client, name: str) -> None:
    """ApiError 404 for a model this gateway does not serve."""
    if name not in client.models():
        raise ApiError(
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
    Raises DisaggError; the caller puts it in its API's shape. The prompt's tokens
    count against its key's share until its first token (disagg.frontends.workers)."""
    req = req.replace(tenant=tenant_tag(request))  # never the caller's to choose
    cost = charge(prompt_tokens(prompt_bytes(req)))
    if not stream:
        return await unless_gone(
            request,
            lambda cancel: client.agenerate(req, model=model, cancel=cancel, executor=workers),
        )
    cancel = threading.Event()
    chunks = await client.agenerate(req, model=model, stream=True, cancel=cancel, executor=workers)
    assert not isinstance(chunks, Completion)
    try:
        # A refusal is raised before the stream opens; once it has, the prompt is prefilled.
        first = await opened_unless_gone(request, chunks, cancel)
    except BaseException:
        cancel.set()
        raise
    finally:
        if isinstance(workers, Workers):
            workers.settle(cost)
    return first, cancel


async def opened_unless_gone(
    request: Request, chunks: AsyncIterator[Chunk], cancel: threading.Event
) -> AsyncIterator[Chunk]:
    """`opened(chunks)`; a client that hangs up meanwhile (its prompt queued or
    prefilling) sets `cancel` at once, not once the stream would have opened."""
    task = asyncio.ensure_future(opened(chunks))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            cancel.set()  # the request's thread stops, so `opened` ends soon
            return await task


@dataclass(frozen=True)
class Usage:
    """What an answer counts, in the names each API renames: tokens of the prompt,
    of the answer, and of the prompt whose K/V came from a prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    verdict: dict[str, Any]  # which path ran (the verdict header's)
    # Prompt-lookup drafts: answer tokens proposed, and of them accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @classmethod
    def of(cls, c: Completion) -> Usage:
        m = c.metrics
        return cls(
            int(m.prompt_tokens or 0),
            int(m.completion_tokens or 0),
            int(m.cached_tokens or 0),
            verdict.verdict(m),
            int(m.draft_tokens or 0),
            int(m.draft_accepted_tokens or 0),
        )

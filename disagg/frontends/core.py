"""What every front door shares over one Client: the run (start), the model
check, the refusal a DisaggError becomes, and the usage an answer counts.

Each API (disagg.frontends.<api>) maps its body straight to a GenerateRequest and
this module's results back to its own wire format; none imports another. A
refusal is an `ApiError` (disagg.frontends.refusal): OpenAI's three APIs answer
its body as is, the others build theirs from its status and message.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from disagg.api import Chunk, Client, Completion
from disagg.errors import AgentError, DisaggError, ModelMismatch, Overloaded, UsageError
from disagg.frontends import tenancy
from disagg.frontends.guard import unless_gone
from disagg.frontends.refusal import ApiError
from disagg.frontends.streamstart import opened
from disagg.serving import verdict
from disagg_agents.wire.request import GenerateRequest


def from_disagg(e: DisaggError) -> ApiError:
    """What a DisaggError tells the client: its status, kind and code."""
    if isinstance(e, AgentError) and not tenancy.operator_now():
        # Agents' addresses are the operator's to see (a stream's error event too).
        e = type(e)(tenancy.hide_addresses(str(e)))
    if isinstance(e, Overloaded):  # OpenAI's clients retry a 429 after Retry-After
        retry = {"Retry-After": str(e.retry_after_s)}
        return ApiError(429, str(e), "requests", code="rate_limit_exceeded", headers=retry)
    if isinstance(e, UsageError):
        return ApiError(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, ModelMismatch):
        return ApiError(502, str(e), "server_error", code="model_mismatch")
    if isinstance(e, AgentError):
        return ApiError(503, str(e), "server_error", code="agent_unavailable")
    return ApiError(500, str(e), "server_error")


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

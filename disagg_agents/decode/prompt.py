"""The first stage: a request's prompt as token ids, its output grammar (compiled
before any compute: a bad schema is a bad request) and its token budget."""

from __future__ import annotations

import socket
import time

from disagg_agents.chatformat import generic
from disagg_agents.decode.engine import BadRequest, DecodeEngine, shown_tools
from disagg_agents.decode.grammar import ANALYSIS_MAX_TOKENS, ClientGone, Framing, Matcher
from disagg_agents.decode.grammarformats import generic_lark
from disagg_agents.decode.job import Job
from disagg_agents.decode.keepalive import Keepalive
from disagg_agents.runtime.hangup import client_gone
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.request import GenerateRequest, RequestError


def open_job(
    eng: DecodeEngine,
    server: str,
    req: GenerateRequest,
    sock: socket.socket,
    progress: Keepalive | None,
) -> Job:
    """The request's Job: prompt ids, grammar, max_tokens and its first metrics
    (`server`: this agent's name)."""
    job = Job(req, sock, progress, time.perf_counter(), time.time())
    job.prompt_ids = eng.encode(req)
    # A migrated request: the answer so far is prompt here (never sent again).
    job.resumed = list(req.resume_ids or [])
    job.input_ids = job.prompt_ids + job.resumed
    job.max_tokens = max_tokens(eng, req, job.input_ids)
    t_grammar = time.perf_counter()
    job.matcher = matcher = request_matcher(eng, req, job.prompt_ids, sock)
    grammar_ms = (time.perf_counter() - t_grammar) * 1000 if matcher is not None else None
    if matcher is not None:
        for tid in job.resumed:
            matcher.consume(tid)  # the grammar's state after the answer so far
        job.allowed = eng.grammars.masks([matcher])[0]
    job.metrics = Metrics(
        prompt_tokens=len(job.prompt_ids),
        resumed_tokens=len(job.resumed) or None,
        kv_bytes=0,
        kv_transfer_time=0.0,
        decode_server=server,
        cached_tokens=0,  # prompt positions whose K/V came from the prefix cache
        weights="same",  # a remote prefill on other weights says "mixed"
        grammar_ms=grammar_ms,  # compiling the output grammar, or its cache hit
    )
    return job


def max_tokens(eng: DecodeEngine, req: GenerateRequest, ids: list[int]) -> int:
    """The request's max_tokens, capped by what the model's context leaves."""
    if len(ids) >= eng.context:
        raise BadRequest(
            f"the prompt is {len(ids)} tokens; the model's context is {eng.context}: "
            "shorten the prompt"
        )
    return min(req.max_tokens, eng.context - len(ids))


def request_matcher(
    eng: DecodeEngine, req: GenerateRequest, ids: list[int], sock: socket.socket | None = None
) -> Matcher | None:
    """The request's output grammar, compiled (or found in the cache) before
    any compute: an invalid or unenforceable schema is a bad request."""
    # <think> templates: the answer (and its constraint) starts after </think>;
    # <think> itself comes first unless the prompt opened it.
    thinks = eng.chat.reasoning and eng.chat.kind != "harmony" and req.think is not False
    opener = eng.think_start if thinks and ids[-1:] != [eng.think_start] else None
    forced = req.tool_choice not in (None, "auto", "none")
    tools = shown_tools(req)
    if eng.is_chat(req) and generic.applies(eng.chat, tools, forced, bool(req.response_format)):
        # A template without tools: the answer is the generic format's JSON.
        try:
            return eng.grammars.matcher(
                {"type": "lark", "grammar": generic_lark(tools or [])},
                gone=None if sock is None else lambda: client_gone(sock),
                tenant=req.tenant or "",
            )
        except ClientGone:
            raise
        except RequestError as e:  # a tool's schema: say so, not our grammar's text
            why = str(e).removeprefix("response_format: ").split(" 1 | ")[0]
            raise RequestError("tools", f"tools: a tool's parameters: {why}") from None
    return eng.grammars.matcher(
        req.response_format,
        framing=Framing(
            eng.format_kind,
            eng.think_end if thinks else None,
            min(ANALYSIS_MAX_TOKENS, req.max_tokens // 2),
            opener,
        ),
        tools=req.tools,
        tool_choice=req.tool_choice,
        gone=None if sock is None else lambda: client_gone(sock),
        tenant=req.tenant or "",
    )

"""Embeddings from a model's prefill agent (`disagg_agents.prefill.embed`): one EMBED
frame per request over an authenticated connection; no decode agent, no K/V."""

from __future__ import annotations

import contextlib
import math
import select
import socket
import threading
import time
from dataclasses import dataclass

from disagg.errors import AgentError, UsageError
from disagg.serving.router import Router
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import recv_json, send_json
from disagg_agents.wire.embedreply import EmbedReply
from disagg_agents.wire.frames import Frame, ProtocolError, RemoteError

EMBED_TIMEOUT_S = 300.0
CANCEL_POLL_S = 0.25


@dataclass
class Embeddings:
    vectors: list[list[float]]  # one per input, L2-normalized
    prompt_tokens: int
    pooling: str  # last, cls, max or mean: from the checkpoint


def embed(
    router: Router,
    model: str,
    texts: list[str],
    *,
    truncate: bool = True,
    max_tokens: int | None = None,
    dimensions: int | None = None,
    cancel: threading.Event | None = None,
) -> Embeddings:
    """`texts` embedded by `model`'s prefill agent. `truncate` False: a text over
    the context (or `max_tokens`) is a UsageError; `dimensions` keeps the first
    that many components, re-normalized. `cancel` set (the client left): the
    connection closes, and the agent stops before its next decoder layer."""
    pipe = router.pipeline(model)
    endpoints = router.order(pipe.prefill)
    if not endpoints:
        raise UsageError(f"model {model} has no prefill agent to compute embeddings")
    ep = endpoints[0]
    request = {"input": texts, "truncate": truncate, "max_tokens": max_tokens}
    try:
        with contextlib.closing(socket.create_connection((ep.host, ep.port), timeout=10)) as s:
            s.settimeout(EMBED_TIMEOUT_S)
            client_auth(s, router.token, pipe.integrity)
            send_json(s, Frame.HELLO, {"role": "embed"})
            recv_json(s, Frame.HELLO_OK)
            send_json(s, Frame.EMBED, request)
            _wait_readable(s, cancel)
            _, doc = recv_json(s, Frame.EMBEDDING, 1 << 30)
        reply = EmbedReply.from_json(doc)
    except RemoteError as e:
        if e.code == "bad_request":
            raise UsageError(str(e), param="input") from None
        raise AgentError(f"prefill agent {ep.name}: {e}") from None
    except (OSError, ProtocolError, ValueError) as e:
        raise AgentError(f"prefill agent {ep.name} at {ep.host}:{ep.port}: {e}") from None
    vectors = [cut(v, dimensions) for v in reply.embeddings]
    return Embeddings(vectors, reply.prompt_tokens, reply.pooling)


def _wait_readable(s: socket.socket, cancel: threading.Event | None) -> None:
    """Until the reply starts (the agent sends it whole), or `cancel` is set."""
    deadline = time.monotonic() + EMBED_TIMEOUT_S
    while not select.select([s], [], [], CANCEL_POLL_S)[0]:
        if cancel is not None and cancel.is_set():
            raise UsageError("the client went away; the embeddings were stopped")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {EMBED_TIMEOUT_S:g}s")


def cut(v: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` components, L2-normalized again (as Ollama does)."""
    if dimensions is None or dimensions >= len(v):
        return v
    head = v[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]

"""One generate request's state as it moves through the decode agent's stages
(prompt -> kvsource -> firsttoken -> stream -> events): each stage reads what the
ones before it set and adds its own part."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from disagg_agents.chatformat import ChatStream
from disagg_agents.decode.grammar import Matcher
from disagg_agents.decode.keepalive import Keepalive
from disagg_agents.decode.loop import Sampler, Seq
from disagg_agents.decode.prefixcache import Hit
from disagg_agents.decode.prefixsave import PendingSave
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.request import GenerateRequest


@dataclass
class Job:
    """A request from GENERATE to DONE. Times are perf_counter seconds on this host
    (`at` alone is Unix time: when the agent took it)."""

    req: GenerateRequest
    sock: socket.socket
    progress: Keepalive | None
    t0: float
    at: float
    # prompt: the prompt's ids; a migrated answer so far; the ids the model takes
    # as input (the prompt, then that answer)
    prompt_ids: list[int] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)  # sent by an agent that died
    input_ids: list[int] = field(default_factory=list)
    max_tokens: int = 0  # the request's, capped by what the context leaves
    matcher: Matcher | None = None  # the output grammar
    allowed: np.ndarray | None = None  # its mask for the first token, [vocab] bool
    metrics: Metrics = field(default_factory=Metrics)
    # kvsource: caches holding the prompt, the logits of its last position
    caches: list[Any] = field(default_factory=list)
    logits: np.ndarray | mx.array | None = None
    marks: dict[str, float | None] | None = None  # a remote fetch's, for the timeline
    hits: list[Hit] = field(default_factory=list)  # prefix cache hits, to save later
    t_local: float = 0.0
    t_prefilled: float = 0.0
    # firsttoken
    sampler: Sampler | None = None
    first_id: int = 0  # the first new token
    first_logprobs: np.ndarray | None = None  # its logprobs, when asked
    t_first: float = 0.0
    parser: ChatStream | None = None  # the answer's parser
    saves: list[PendingSave] = field(default_factory=list)
    first_frame_metrics: Metrics | None = None  # the first TOKEN frame's metrics
    # stream: the tokens sent and the batch row (None: it ended with its first token)
    out: list[int] = field(default_factory=list)
    seq: Seq | None = None
    t_end: float = 0.0

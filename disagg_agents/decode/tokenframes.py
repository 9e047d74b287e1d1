"""The TOKEN frames a request sends as its tokens complete text or a tool call
(the first with the prompt's side of the metrics), in bursts: what the decode
stage sends and the events stage closes with."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
from collections.abc import Iterator

import numpy as np

from disagg_agents.chatformat import ParsedCall, Piece
from disagg_agents.wire.answer import CONTENT, REASONING, Metrics, TokenEvent, ToolCall
from disagg_agents.wire.channel import send_json
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.timeline import Timeline

# What is known once the first token is out: a client that stops reading early (a stop
# string matched, its caller left) still reports the prompt's side of the request.
FIRST_METRICS = (
    "prompt_tokens",
    "cached_tokens",
    "prefill_cached_tokens",
    "disk_cached_tokens",
    "method",
    "prefill_server",
    "decode_server",
    "prefill_time",
    "prefill_queue_time",
    "kv_bytes",
    "kv_transfer_time",
    "weights",
    "placement",
    "placement_reason",
    "fallback_reason",
    "fallback_kind",
)


def first_metrics(metrics: Metrics, at: float, t0: float, t_first: float) -> Metrics:
    """The first TOKEN frame's `metrics`: the prompt's side, the agent's ttft, and the
    timeline so far (`at`, first_token in seconds after it)."""
    early = Metrics.from_json(
        {k: v for k in FIRST_METRICS if (v := getattr(metrics, k)) is not None}
    )
    early.ttft = t_first - t0
    early.timeline = Timeline(at=at, first_token=t_first - t0)
    return early


def token_events(
    tid: int | None, events: list[Piece | ParsedCall], metrics: Metrics | None = None
) -> list[TokenEvent]:
    """What one token completed, as TOKEN frames: the first carries the id (one per
    token, even when markup shows nothing) and on the request's first token its
    `metrics` (first_metrics); text on one channel rides in one frame; a finished
    tool call rides alone."""
    out: list[TokenEvent] = []
    for e in events:
        if isinstance(e, Piece):
            channel = REASONING if e.channel == REASONING else CONTENT
            last = out[-1] if out else None
            if last is not None and last.channel == channel and last.tool_call is None:
                out[-1] = dataclasses.replace(last, text=last.text + e.text)
            else:
                out.append(TokenEvent(text=e.text, channel=channel))
        else:
            out.append(TokenEvent(tool_call=ToolCall(e.name, e.arguments, e.text)))
    if tid is not None:
        out[:1] = [dataclasses.replace(out[0] if out else TokenEvent(), id=tid)]
    if metrics is not None and out:
        out[0] = dataclasses.replace(out[0], metrics=metrics)
    return out


def send_events(
    sock: socket.socket,
    tid: int | None,
    events: list[Piece | ParsedCall],
    metrics: Metrics | None = None,
) -> None:
    """The TOKEN frames for what one token completed (token_events)."""
    for event in token_events(tid, events, metrics):
        send_json(sock, Frame.TOKEN, event.to_json())


Item = tuple[int, "np.ndarray | None"]


def bursts(out: queue.Queue[Item | Exception | None]) -> Iterator[list[Item]]:
    """A request's tokens as the loop queued them, in bursts: whatever queued up
    while the last burst was being sent (a lagging client) goes out together."""
    while True:
        got = out.get()
        burst: list[Item] = []
        while True:
            if got is None:
                if burst:
                    yield burst
                return
            if isinstance(got, Exception):
                if burst:
                    yield burst
                raise got
            burst.append(got)
            try:
                got = out.get_nowait()
            except queue.Empty:
                break
        yield burst


@contextlib.contextmanager
def corked(sock: socket.socket, on: bool) -> Iterator[None]:
    """A burst's frames in as few TCP segments as fit (Linux TCP_CORK): one
    wake-up for a lagging client instead of one per token."""
    cork = getattr(socket, "TCP_CORK", None)
    if not on or cork is None:
        yield
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, cork, 1)
    except OSError:  # not TCP: nothing to coalesce
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, cork, 0)

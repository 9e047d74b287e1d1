"""Send one generate request to a decode agent and read its streamed answer."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.errors import (
    AgentError,
    AuthError,
    ConnectError,
    DisaggError,
    ModelMismatch,
    RequestTimeout,
    UsageError,
)
from disagg.serving.completion import Completion
from disagg_agents.wire.answer import Done, TokenEvent
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import recv_frame, send_json
from disagg_agents.wire.frames import (
    Frame,
    Header,
    PeerAuthError,
    ProtocolError,
    RemoteError,
    decode_json,
)
from disagg_agents.wire.request import GenerateRequest

# The name earlier releases gave the wire client's result: the one answer type.
Result = Completion

CANCEL_POLL_S = 0.2  # how often a wait for the agent's next frame looks at `cancel`


class Cancelled(Exception):
    """`cancel` was set while the agent had nothing to send yet (its prompt
    queued or prefilling): the connection closes, which stops the agent's work."""


def _raise_remote(e: RemoteError) -> None:
    if e.code == "model_mismatch":
        raise ModelMismatch(e.message) from None
    if e.code == "bad_request":
        raise UsageError(e.message) from None
    if e.code == "unauthorized":
        raise AuthError(e.message) from None
    raise AgentError(f"{e.code}: {e.message}") from None


# A typed request, or a GENERATE frame's JSON as is (tests of the wire send those).
Request = GenerateRequest | Mapping[str, Any]


@dataclass(frozen=True)
class Logprobs:
    """One LOGPROBS frame: the token's log-probabilities, float32 over the vocab."""

    values: np.ndarray


# What `stream` yields: a TokenEvent per TOKEN frame, Logprobs, and last the Done.
Event = TokenEvent | Logprobs | Done


def stream(
    host: str,
    port: int,
    request: Request,
    timeout_s: float = 240.0,
    token: bytes | None = None,
    deadline_s: float | None = None,
    cancel: threading.Event | None = None,
) -> Generator[Event, None, None]:
    """Yield a TokenEvent per TOKEN frame, Logprobs per LOGPROBS frame and finally
    the Done: the answer as typed in disagg_agents.wire.answer.

    `timeout_s` is an idle deadline: the agent failed when it sent no frame for that
    long (it sends PROGRESS while it queues or prefills, so only a dead or hung one
    does). `deadline_s`, when given, bounds the whole request: RequestTimeout then.
    `cancel` set (the caller left) while no frame is due: Cancelled."""
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout_s, 10.0))
    except OSError as e:
        raise ConnectError(f"cannot reach decode agent at {host}:{port}: {e}") from None
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        _open(sock, host, port, timeout_s, token)
        wire = request.to_wire() if isinstance(request, GenerateRequest) else dict(request)
        # Its progress_s: three PROGRESS frames per idle deadline, so one late frame
        # is no failure.
        wire.setdefault("progress_s", max(timeout_s / 3, 0.1))
        send_json(sock, Frame.GENERATE, wire)
        while True:
            where = f"{host}:{port}"
            header, payload = _recv(sock, timeout_s, deadline, where, deadline_s, cancel)
            if header.type == Frame.PROGRESS:
                continue  # still working (queued, prefilling): only the idle clock hears it
            if header.type == Frame.TOKEN:
                yield TokenEvent.from_json(decode_json(header, payload))
            elif header.type == Frame.LOGPROBS:
                yield Logprobs(np.frombuffer(bytes(payload), np.float32))
            elif header.type == Frame.DONE:
                yield Done.from_json(decode_json(header, payload))
                return
            elif header.type == Frame.ERROR:
                err = decode_json(header, payload)
                _raise_remote(RemoteError(str(err.get("code")), str(err.get("message"))))
            else:
                raise AgentError(f"decode agent sent an unexpected {header.type.name} frame")
    except TimeoutError:
        raise AgentError(
            f"decode agent {host}:{port} sent nothing for {timeout_s:g}s (hung or unreachable)"
        ) from None
    except ProtocolError as e:
        raise AgentError(f"decode agent {host}:{port}: {e}") from None
    except OSError as e:
        if isinstance(e, DisaggError):
            raise
        raise AgentError(f"decode agent {host}:{port} connection failed: {e}") from None
    finally:
        sock.close()


def _open(sock: socket.socket, host: str, port: int, timeout_s: float, token: bytes | None) -> None:
    """Prove the cluster token to the decode agent on a fresh connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(min(timeout_s, 10.0))
    try:
        client_auth(sock, token)
    except PeerAuthError as e:
        raise AuthError(
            f"decode agent {host}:{port}: {e}; fix: use the cluster's token "
            "(disagg deploy writes it; --local makes its own)"
        ) from None
    except TimeoutError:
        raise AgentError(
            f"decode agent {host}:{port} accepted the connection but did not open it "
            f"within {min(timeout_s, 10.0):.0f}s (overloaded or hung?)"
        ) from None


def _await(sock: socket.socket, cancel: threading.Event | None, wait_s: float) -> None:
    """Until the next frame's first byte is here: TimeoutError after `wait_s`,
    Cancelled once `cancel` is set."""
    if cancel is None:
        return
    end = time.monotonic() + wait_s
    while not select.select([sock], [], [], CANCEL_POLL_S)[0]:
        if cancel.is_set():
            raise Cancelled("the caller left before the answer was done")
        if time.monotonic() >= end:
            raise TimeoutError("timed out")


def _recv(
    sock: socket.socket,
    timeout_s: float,
    deadline: float | None,
    where: str,
    deadline_s: float | None,
    cancel: threading.Event | None = None,
) -> tuple[Header, bytearray]:
    """The next frame, waiting at most the idle `timeout_s` (TimeoutError) and no
    longer than the request's `deadline` (monotonic; RequestTimeout); Cancelled
    once `cancel` is set while it waits."""
    while True:
        wait = timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(
                    f"decode agent {where} was still working when the request's "
                    f"deadline of {deadline_s:.1f}s passed"
                )
            wait = min(wait, left)
        sock.settimeout(wait)
        try:
            _await(sock, cancel, wait)
            return recv_frame(sock)
        except TimeoutError:
            if deadline is not None and deadline - time.monotonic() <= 0:
                continue  # the request's deadline, not the agent's silence
            raise


def generate(
    host: str,
    port: int,
    request: Request,
    on_text: Callable[[str], None] | None = None,
    timeout_s: float = 240.0,
    on_token: Callable[[TokenEvent], None] | None = None,
    token: bytes | None = None,
    deadline_s: float | None = None,
    cancel: threading.Event | None = None,
) -> Completion:
    """Run one request to completion (`timeout_s`, `deadline_s`, `cancel`: see `stream`).

    `on_text` sees each piece of answer text as it arrives; `on_token` each
    TokenEvent. An exception raised by either ends the request and closes the
    connection, which tells the decode agent to stop.
    """
    t0 = time.perf_counter()
    events = stream(host, port, request, timeout_s, token, deadline_s, cancel)
    with contextlib.closing(events):
        return _collect(host, port, events, t0, on_text, on_token)


def _collect(
    host: str,
    port: int,
    events: Iterator[Event],
    t0: float,
    on_text: Callable[[str], None] | None,
    on_token: Callable[[TokenEvent], None] | None,
) -> Completion:
    ttft = None
    logprobs: list[np.ndarray] = []
    for event in events:
        if isinstance(event, TokenEvent):
            if ttft is None and event.id is not None:
                ttft = time.perf_counter() - t0
            if on_token:
                on_token(event)
            if on_text and event.text and not event.is_reasoning:
                on_text(event.text)
        elif isinstance(event, Logprobs):
            logprobs.append(event.values)
        else:
            result = Completion.from_done(event, logprobs)
            metrics = result.metrics
            # The agent's ttft is its own; the client's includes the way here.
            metrics.agent_ttft, metrics.ttft = metrics.ttft, ttft
            metrics.total_time = time.perf_counter() - t0
            return result
    raise AgentError(f"decode agent {host}:{port} closed the stream without a result")

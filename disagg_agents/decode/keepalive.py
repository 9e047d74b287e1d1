"""PROGRESS frames while a request has no token to send.

A client's decode timeout is an idle deadline: no frame for that long means the
agent is gone. A request that waits (for a batch slot, for a prefill agent's K/V,
for its own local prefill) sends nothing meanwhile, so when the request asks
(`GenerateRequest.progress_s`), a thread sends a small PROGRESS frame every so often
and a working agent is never taken for a dead one. It speaks only while the decode
loop answers (a no-op posted to the loop has run since the last frame): a hung loop
goes silent and its client fails over as before.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Protocol

from disagg_agents.wire.channel import send_json, serialize_sends
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.request import GenerateRequest

MIN_EVERY_S = 0.1  # a client cannot make us spin


class Loop(Protocol):
    def post(self, fn: Any, *args: Any) -> Future[Any]: ...


def progress_interval(req: GenerateRequest) -> float | None:
    """Seconds between PROGRESS frames for `req`, or None (the client did not ask:
    an older client knows no such frame). The request checked it is > 0."""
    if req.progress_s is None:
        return None
    return max(float(req.progress_s), MIN_EVERY_S)


def _nothing() -> None:
    return None


class Keepalive:
    """`with Keepalive(sock, every, loop) as k:` sends PROGRESS every `every` s
    until the block ends or `stop()` (call it before the last frame: nothing may
    follow DONE). `seq` (a batching.Seq, once joined) tells queued from decoding.
    Sends share the socket with the request's own thread: protocol.serialize_sends."""

    def __init__(self, sock: Any, every: float | None, loop: Loop) -> None:
        self.sock, self.every, self.loop = sock, every, loop
        self.seq: Any = None
        self.sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Keepalive:
        if self.every is not None:
            serialize_sends(self.sock)
            self._thread = threading.Thread(target=self._run, daemon=True, name="keepalive")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def phase(self) -> dict[str, Any]:
        seq = self.seq
        if seq is None:
            return {"phase": "prefill"}  # remote K/V, a local prefill, or the first token
        if seq.joined_at is None:
            return {"phase": "queued", "tokens": seq.produced}  # waiting for a batch slot
        return {"phase": "decode", "tokens": seq.produced}

    def _run(self) -> None:
        assert self.every is not None
        probe = self.loop.post(_nothing)
        while not self._stop.wait(self.every):
            if not probe.done():
                continue  # the loop has not come round since the last frame: say nothing
            try:
                send_json(self.sock, Frame.PROGRESS, self.phase())
            except OSError:
                return  # the client is gone; the request's own thread finds out
            self.sent += 1
            probe = self.loop.post(_nothing)

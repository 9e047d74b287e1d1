"""Which path ran, said on every answer: a response header on each front door.

A benchmark round of another bridge turned out to be silent local fallbacks:
`method` and `rerouted_from` sat in metrics a client sees only when it asks for
internals. The verdict names no agent and no address, so every caller gets it:

    X-Disagg-Verdict: path=remote; cached_tokens=512; from_memory=496; from_disk=0;
                      from_prefill_agent=16; migrations=0

`path`: remote (a prefill agent's K/V), local (the decode agent prefilled by
choice), local-after-failure (it fell back when the prefill agent failed),
decode-only (no prefill agent). A streamed answer's header is sent once its first
token is out and says what was known then (no migrations: they come later; its
final event's metrics carry them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from disagg.serving.completion import Chunk, Completion
from disagg_agents.wire.answer import Metrics

HEADER = "X-Disagg-Verdict"
PATHS = {
    "disaggregated": "remote",
    "local": "local",
    "local-fallback": "local-after-failure",
    "decode-only": "decode-only",
}


def verdict(m: Metrics, final: bool = True) -> dict[str, Any]:
    """The verdict's fields from a result's metrics (`final`: the whole answer's,
    so migrations are known)."""
    # cached_tokens: the decode agent's hit (memory and disk); the prefill agent's
    # own hit may cover more of the prompt (a decode agent restarted without a disk
    # tier), and only what it adds past the decode agent's counts for it.
    here = int(m.cached_tokens or 0)
    disk = min(here, int(m.disk_cached_tokens or 0))
    by_prefill = max(0, int(m.prefill_cached_tokens or 0) - here)
    out: dict[str, Any] = {
        "path": PATHS.get(str(m.method), m.method or "unknown"),
        "cached_tokens": here + by_prefill,
        "from_memory": here - disk,
        "from_disk": disk,
        "from_prefill_agent": by_prefill,
    }
    if final:
        out["migrations"] = int(m.migrations or 0)
    return out


def header_value(m: Metrics, final: bool = True) -> str:
    return "; ".join(f"{k}={v}" for k, v in verdict(m, final).items())


def parse(value: str) -> dict[str, str]:
    """A verdict header back as fields (for clients and tests)."""
    pairs = (p.split("=", 1) for p in value.split(";") if "=" in p)
    return {k.strip(): v.strip() for k, v in pairs}


def headers(m: Metrics) -> dict[str, str]:
    """A whole answer's response headers."""
    return {HEADER: header_value(m)}


def whole(body: Any, c: Completion) -> JSONResponse:
    """A whole answer's JSON body with its verdict header."""
    return JSONResponse(jsonable_encoder(body), headers=headers(c.metrics))


def streamed(
    render: Callable[[AsyncIterator[Chunk]], AsyncIterable[str]],
    chunks: AsyncIterator[Chunk],
    **kw: Any,
) -> StreamingResponse:
    """A streamed answer (`render` turns its chunks into the API's events) whose
    headers carry the verdict as of its first token."""
    seen = Seen()
    return VerdictStream(render(seen.watch(chunks)), seen, **kw)


class Seen:
    """What a stream's chunks told so far: the first token's metrics (the path)."""

    def __init__(self) -> None:
        self.metrics: Metrics | None = None
        self.known = asyncio.Event()

    async def watch(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """`chunks` passed on, noting the first metrics that ride on one."""
        try:
            async for chunk in chunks:
                m = chunk.metrics or (chunk.completion.metrics if chunk.completion else None)
                if m is not None and self.metrics is None:
                    self.metrics = m
                    self.known.set()
                yield chunk
        finally:
            self.known.set()


class VerdictStream(StreamingResponse):
    """A streamed answer whose headers wait for its first token's metrics (or its
    end), so they can carry the verdict. Whatever the body yields meanwhile is held
    and sent right after the headers: the bytes are the same, only later."""

    def __init__(self, content: AsyncIterable[str], seen: Seen, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.seen = seen

    async def stream_response(self, send: Send) -> None:
        it = aiter(self.body_iterator)
        held: list[Any] = []
        pending: asyncio.Future[Any] | None = asyncio.ensure_future(anext(it))
        known = asyncio.ensure_future(self.seen.known.wait())
        try:
            while pending is not None and not known.done():
                await asyncio.wait({pending, known}, return_when=asyncio.FIRST_COMPLETED)
                if pending.done():
                    try:
                        held.append(pending.result())
                    except StopAsyncIteration:
                        pending = None
                        break
                    pending = asyncio.ensure_future(anext(it))
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        finally:
            known.cancel()
        if self.seen.metrics is not None:
            self.headers[HEADER] = header_value(self.seen.metrics, final=False)
        self.body_iterator = _chain(held, pending, it)
        await super().stream_response(send)


async def _chain(
    held: list[Any], pending: asyncio.Future[Any] | None, rest: AsyncIterator[Any]
) -> AsyncIterator[Any]:
    for piece in held:
        yield piece
    if pending is None:
        return
    try:
        yield await pending
    except StopAsyncIteration:
        return
    async for piece in rest:
        yield piece

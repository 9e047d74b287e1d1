"""A stream opens only once its request is known to be servable: the first
chunk (or the refusal) is awaited before any status line goes out, so a request
that cannot be served is a 4xx in its API's shape, never a 200 followed by a
failure event (clients such as Codex retry a failed stream as a network fault).

The wait is bounded: the agent checks a request (its size, template, tools,
grammar) before any compute, so a refusal comes at once; a long prefill opens
the stream after `GRACE_S` and reports anything later as the API's event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
# Above the agent's grammar-compile budget (10 s), so a grammar's refusal is a 4xx too.
GRACE_S = 15.0


async def opened(chunks: AsyncIterator[T], grace_s: float = GRACE_S) -> AsyncIterator[T]:
    """`chunks` again, after waiting up to `grace_s` for its first item; an error
    raised by then is raised here, before the caller opens its response."""
    first = asyncio.ensure_future(anext(chunks))
    done, _ = await asyncio.wait({first}, timeout=grace_s)
    if done:
        with contextlib.suppress(StopAsyncIteration):
            first.result()  # raises the refusal now
    return _rest(first, chunks)


async def _rest(first: asyncio.Future[T], chunks: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield await first
    except StopAsyncIteration:
        return
    async for item in chunks:
        yield item

"""A request's prompt blocks saved into the block store (disagg_agents.prefix.store),
taken from the request's caches without a copy.

Its blocks become numpy views of the request's cache buffers once the decode
loop stops writing them (`Seq.released`): when the request joins a batch (the
merge copies its caches into the batch anyway) or ends. Until then the save is
pending: the request's own thread runs it as soon as the caches are released
(between its token bursts, and at its end, before DONE, so the next turn of a
chat finds it). A lookup that a pending save would serve better takes it now
(`take_now`): a lone request's caches are copied for the loop to go on with,
and the save keeps the originals. That is the one copy the old code made for
every saved prompt, made only when another request wants the prefix while the
first still decodes alone.

A request that fails saves nothing.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from disagg_agents.decode.prefixcache import DecodePrefixCache, Hit, Span

if TYPE_CHECKING:
    from disagg_agents.decode.loop import DecodeLoop, Seq

log = logging.getLogger("disagg.prefix")

# How long a finished request waits for the loop to release its caches (it does
# at once; this only bounds a path that forgot to).
RELEASE_WAIT_S = 5.0


def merged(a: list[Span | None], b: list[Span | None]) -> list[Span | None]:
    """Per layer, whichever of the two has a span."""
    return [x if x is not None else y for x, y in zip(a, b, strict=True)]


class PendingSave:
    """One request's save, run once by whoever comes first: its own thread when
    the loop releases its caches, or a lookup that wants its prefix now."""

    def __init__(
        self,
        prefix: DecodePrefixCache,
        loop: DecodeLoop,
        hit: Hit,
        prompt_len: int,
        sliding: list[Span | None],
    ) -> None:
        self.prefix = prefix
        self.loop = loop
        self.hit = hit
        self.prompt_len = prompt_len
        self.sliding = sliding  # recorded sliding layers (a local prefill)
        self.released: Future[list[Any]] = Future()  # the loop sets it (Seq.released)
        self.seq: Seq | None = None
        self.lock = threading.Lock()
        self.done = False

    @property
    def keys(self) -> list[bytes]:
        return self.hit.keys

    def now(self, caches: list[Any]) -> None:
        """Save from caches that nothing writes (the request never decoded)."""
        with self.lock:
            self._save(caches)

    def attach(self, seq: Seq) -> None:
        """Before `seq` joins the loop: the loop hands its caches here when it
        lets them go, and lookups may take the save from now on."""
        self.seq = seq
        seq.released = self.released
        self.prefix.pending_add(self)

    def poll(self) -> None:
        """Between token bursts: save if the caches were released (never waits)."""
        if self.done or not self.released.done():
            return
        if self.lock.acquire(blocking=False):
            try:
                self._save(self.released.result())
            finally:
                self.lock.release()

    def finish(self) -> None:
        """At the request's end: the loop releases its caches right after the
        last token; save before DONE."""
        if self.done or self.seq is None:
            return
        try:
            caches = self.released.result(RELEASE_WAIT_S)
        except FutureTimeout:
            log.warning("decode loop never released a finished request's caches: not saved")
            self.drop()
            return
        with self.lock:
            self._save(caches)

    def take_now(self) -> None:
        """A lookup wants this prefix: save it now (see the module's note)."""
        seq = self.seq
        with self.lock:
            if self.done or seq is None:
                return
            if not self.released.done():
                self.loop.call(self.loop.hand_over_caches, seq)
            if self.released.done():  # not when it waits for a batch slot
                self._save(self.released.result())

    def drop(self) -> None:
        """Nothing (more) to save: the request failed, or it is saved. Under the
        lock: a lookup may be saving from these caches right now (`take_now`), and
        a request that fails meanwhile must wait for it, not pull the caches and
        the recorded layers out from under it."""
        with self.lock:
            self._drop()

    def _drop(self) -> None:
        self.done = True
        self.sliding = []
        self.prefix.pending_remove(self)
        if self.released.done():
            self.released.result().clear()  # the loop's list, which only we still hold

    def _save(self, caches: list[Any]) -> None:
        if self.done:
            return
        try:
            spans = self.loop.call(self.prefix.full_views, caches, self.prompt_len)
            self.prefix.save(self.hit, merged(self.sliding, spans))
        except Exception:  # a save that fails must not fail the request
            log.exception("saving a prompt's prefix blocks failed")
        finally:
            caches.clear()  # what the block store keeps it holds itself (views or copies)
            self._drop()  # the lock is ours

"""The Python API: `Client.local()` or `Client(inventory)`, then `generate`.

from disagg import Client
with Client.local() as c:
    print(c.generate(prompt="What is the capital of France?").text)

`generate` returns a `Completion`; with stream=True it yields `Chunk`s, its pieces,
the last one done and holding the whole Completion (disagg.serving.completion).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from disagg.errors import DisaggError, UsageError
from disagg.serving.checkedrequest import build_request
from disagg.serving.completion import Chunk, Completion
from disagg.serving.defaultmodel import Say, resolve_model
from disagg.serving.localagents import (
    AgentProc,
    make_token_file,
    start_local_agents,
    stop_agents,
)
from disagg.serving.localdisk import LocalDisk
from disagg.serving.metrics import Metrics
from disagg.serving.router import Endpoint, Route, Router, StopGeneration
from disagg.serving.stops import StopMatcher
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest


class Client:
    """Generate on a disagg cluster (an inventory) or on local agents."""

    def __init__(self, inventory: str | Path | None = None, *, router: Router | None = None):
        self.inventory: Any = None  # the fleet's Inventory (the web view reads crash lines)
        if router is None:
            # Lazy: only fleet users need the inventory and SSH code.
            from disagg.fleet.inventory import load
            from disagg.fleet.routing import router_from_inventory

            self.inventory = load(inventory)
            router = router_from_inventory(self.inventory)
        self.router = router
        self.agents: list[AgentProc] = []
        self.model_dirs: dict[str, Path] = {}  # local pipelines: name -> model dir
        self.temp_dirs: list[Path] = []  # local agents' token and log dirs, removed on close

    @classmethod
    def local(
        cls,
        model: str | None | list[str | None] = None,
        *,
        n_decode: int = 1,
        dtype: str = "auto",
        say: Say = lambda _msg: None,
        prefill_model: str | None = None,
        allow_mixed: bool = False,
        prefix_disk: LocalDisk | None = None,
        speculate: bool = True,
    ) -> Client:
        """Start a prefill and `n_decode` decode agents per model on this machine.

        `model`: a model dir, several (one pipeline each, named by the dir), or None
        for the embedded default. `prefill_model`: the prefill agent loads that dir
        instead (one model only); agents on different weights refuse to pair unless
        `allow_mixed`, and results then say weights: "mixed". `prefix_disk`: the
        decode agents keep prefix blocks there, across restarts (the cluster's token
        is kept there too). `speculate`: False: --no-speculate. close() stops them."""
        wanted = model if isinstance(model, list) else [model]
        if prefill_model is not None and len(wanted) != 1:
            raise UsageError("--prefill-model goes with exactly one --model")
        prefill_dir = resolve_model(prefill_model, say) if prefill_model is not None else None
        dirs = _model_dirs(wanted, say)
        pipelines, agents = [], []
        # One cluster: every local agent shares one fresh token. Its dir and the
        # agents' log dirs go when the client closes.
        sweep_orphans()
        temp_dirs = [Path(tempfile.mkdtemp(prefix=LOCAL_PREFIX))]
        (temp_dirs[0] / OWNER_FILE).write_text(str(os.getpid()))
        # With a disk tier, the token kept there: its MAC key and the salts come from it.
        token_file, token = make_token_file(prefix_disk.root if prefix_disk else temp_dirs[0])
        try:
            for name, path in dirs.items():
                temp_dirs.append(Path(tempfile.mkdtemp(prefix="disagg-logs-")))
                prefill, decodes = start_local_agents(
                    path,
                    n_decode=n_decode,
                    dtype=dtype,
                    log_dir=temp_dirs[-1],
                    token_file=token_file,
                    prefill_model_dir=prefill_dir,
                    decode_args=[
                        *(["--allow-mixed"] if allow_mixed else []),
                        *([] if speculate else ["--no-speculate"]),
                    ],
                    decode_disk=_disk_flags(prefix_disk, name),
                )
                agents += [prefill, *decodes]
                pipelines.append(_local_route(name, prefill, decodes))
        except BaseException:
            stop_agents(agents)
            _remove(temp_dirs)
            raise
        client = cls(router=Router(pipelines, token=token))
        client.agents = agents
        client.model_dirs = dirs
        client.temp_dirs = temp_dirs
        return client

    def close(self) -> None:
        stop_agents(self.agents)  # all at once: each drains, then exits
        self.agents = []
        _remove(self.temp_dirs)
        self.temp_dirs = []

    def stop_now(self) -> None:
        """Kill the local agents without waiting for them to drain; remove temp files."""
        for agent in self.agents:
            agent._stopped = True  # on purpose: nobody restarts it
            with contextlib.suppress(OSError):
                agent.proc.kill()
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(5)
        self.agents = []
        _remove(self.temp_dirs)
        self.temp_dirs = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def models(self) -> list[str]:
        return self.router.models()

    def generate(
        self,
        request: GenerateRequest | None = None,
        *,
        model: str | None = None,
        stream: bool = False,
        cancel: threading.Event | None = None,
        deadline_s: float | None = None,
        **fields: Any,
    ) -> Completion | Iterator[Chunk]:
        """Text plus the seed's metrics, or with stream=True an iterator of chunks
        whose last one has done=True and the Completion.

        `request`: a `GenerateRequest`; or its fields as keywords (prompt= or
        messages=, max_tokens=, temperature=, top_p=, stop=, seed=, ...). Setting
        `cancel` stops decoding at the next token (a gateway's client hung up).
        `deadline_s` bounds the whole request (RequestTimeout); by default only a
        decode agent's silence fails it (the pipeline's decode_timeout).
        """
        request = _request_from(request, fields)
        name = self.router.pipeline(model).name
        if stream:
            return self._stream(name, request, cancel, deadline_s)
        return self._run(name, request, lambda _chunk: None, cancel, deadline_s)

    def _run(
        self,
        model: str,
        req: GenerateRequest,
        emit: Callable[[Chunk], None],
        cancel: threading.Event | None = None,
        deadline_s: float | None = None,
    ) -> Completion:
        matcher = StopMatcher(req.stop)  # stop sequences end the answer, not the reasoning
        count = 0
        reasoning: list[str] = []

        def on_token(tok: TokenEvent) -> None:
            nonlocal count
            if cancel is not None and cancel.is_set():
                raise StopGeneration("cancelled")
            count += tok.id is not None
            if tok.metrics is not None:
                emit(Chunk("", metrics=tok.metrics))  # which path ran (a verdict header)
            if tok.is_reasoning:
                if tok.text:
                    reasoning.append(tok.text)
                    emit(Chunk("", reasoning=tok.text))
                return
            text = matcher.feed(tok.text)
            if text:
                emit(Chunk(text))
            if matcher.hit:
                raise StopGeneration

        try:
            result = self.router.run(
                model, req, on_token=on_token, deadline_s=deadline_s, cancel=cancel
            )
        except StopGeneration as e:  # a stop string matched, or the caller left
            m = e.metrics or Metrics(completion_tokens=count, finish_reason=e.reason)
            done = Completion(matcher.text, [], m, e.reason, model, "".join(reasoning))
            done.stop_sequence = matcher.matched
            return done
        tail = matcher.flush()
        if tail:
            emit(Chunk(tail))
        m = result.metrics
        # An agent of an older release may leave finish_reason out.
        result.finish_reason = m.finish_reason or (
            "length" if m.completion_tokens == req.max_tokens else "stop"
        )
        result.model = model
        return result

    def _produce(
        self,
        model: str,
        req: GenerateRequest,
        cancelled: threading.Event,
        deadline_s: float | None,
        put: Callable[[Chunk | BaseException], None],
    ) -> None:
        """Run a streamed request on this thread, handing each chunk (then the
        done one, or the exception) to `put`; `cancelled` stops it at the next token."""

        def emit(chunk: Chunk) -> None:
            if cancelled.is_set():
                raise StopGeneration("cancelled")  # the consumer went away: stop decoding
            put(chunk)

        try:
            done = self._run(model, req, emit, cancelled, deadline_s)
            put(Chunk("", done=True, completion=done))
        except BaseException as e:  # handed to the consumer's thread
            put(e)

    def _stream(
        self,
        model: str,
        req: GenerateRequest,
        cancel: threading.Event | None = None,
        deadline_s: float | None = None,
    ) -> Iterator[Chunk]:
        q: queue.Queue[Chunk | BaseException] = queue.Queue()
        cancelled = cancel or threading.Event()
        work = functools.partial(self._produce, model, req, cancelled, deadline_s, q.put)
        threading.Thread(target=work, daemon=True, name="disagg-stream").start()
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.done:
                    return
        finally:
            cancelled.set()

    async def agenerate(
        self,
        request: GenerateRequest | None = None,
        *,
        model: str | None = None,
        stream: bool = False,
        cancel: threading.Event | None = None,
        deadline_s: float | None = None,
        executor: Executor | None = None,
        **fields: Any,
    ) -> Completion | AsyncIterator[Chunk]:
        """The async twin of generate: awaits a Completion, or gives an async iterator.

        The request runs on a thread of `executor` (default: the event loop's pool for
        one answer, a thread of its own for a stream); a gateway passes its Workers,
        whose submit may refuse with Overloaded. A stream's chunks reach the event
        loop through an asyncio.Queue; leaving the iterator stops the decoding."""
        request = _request_from(request, fields)
        loop = asyncio.get_running_loop()
        if not stream:
            run = functools.partial(
                self.generate, request, model=model, cancel=cancel, deadline_s=deadline_s
            )
            result = await loop.run_in_executor(executor, run)
            assert isinstance(result, Completion)
            return result
        name = self.router.pipeline(model).name
        cancelled = cancel or threading.Event()
        chunks: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()

        def put(item: Chunk | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody will read
                cancelled.set()

        work = functools.partial(self._produce, name, request, cancelled, deadline_s, put)
        if executor is None:
            threading.Thread(target=work, daemon=True, name="disagg-stream").start()
        else:
            executor.submit(work)
        return _drain(chunks, cancelled)


LOCAL_PREFIX = "disagg-local-"  # a local cluster's token folder, in the temp dir
OWNER_FILE = "owner.pid"


def sweep_orphans(root: Path | None = None) -> list[Path]:
    """Remove the token folders of local clusters whose process is gone (a gateway
    killed by a signal cleans nothing up): ours only, their owner's pid dead."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(LOCAL_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or one being made right now
        try:
            os.kill(pid, 0)
            continue  # alive (or another user's: PermissionError below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _disk_flags(disk: LocalDisk | None, model: str) -> Callable[[str], list[str]] | None:
    """A local decode agent's prefix disk flags, by its name (None: no tier)."""
    if disk is None:
        return None
    return lambda agent: [
        "--prefix-disk",
        str(disk.agent_dir(model, agent)),
        "--prefix-disk-mb",
        f"{disk.mb:g}",
    ]


def _remove(dirs: list[Path]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _request_from(request: GenerateRequest | None, fields: dict[str, Any]) -> GenerateRequest:
    """The Python API takes a request, or its fields as keywords."""
    if request is None:
        if ("prompt" in fields) == ("messages" in fields):
            raise UsageError("give exactly one of prompt= or messages=")
        return build_request(**fields)
    if fields:
        raise UsageError(f"give a request or its fields, not both: {', '.join(fields)}")
    return request


async def _drain(
    chunks: asyncio.Queue[Chunk | BaseException], cancelled: threading.Event
) -> AsyncIterator[Chunk]:
    """A stream's chunks as the worker thread puts them; leaving early (the
    client hung up, the task was cancelled) stops the decoding at the next token."""
    try:
        while True:
            item = await chunks.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.done:
                return
    finally:
        cancelled.set()


__all__ = ["Chunk", "Client", "Completion", "DisaggError", "GenerateRequest", "Metrics"]


def _local_route(name: str, prefill: AgentProc, decodes: list[AgentProc]) -> Route:
    """One pipeline of agents on this machine."""
    return Route(
        name,
        [Endpoint(prefill.name, prefill.host, prefill.port, prefill.control_port)],
        [Endpoint(d.name, d.host, d.port, d.control_port) for d in decodes],
        # Both ends on this machine's loopback: no path to protect the K/V on, so
        # no tags to pay for (a fleet pipeline's default: mac).
        integrity="none",
    )


def _model_dirs(wanted: list[str | None], say: Say) -> dict[str, Path]:
    """Each asked-for model's local dir, by its name (the dir's)."""
    dirs = {}
    for m in wanted:
        path = resolve_model(m, say)
        dirs[path.name] = path
    return dirs

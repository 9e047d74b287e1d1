"""The Python API: `Client.local()` or `Client(inventory)`, then `generate`.

from disagg import Client
with Client.local() as c:
    print(c.generate(prompt="What is the capital of France?").text)
"""

from __future__ import annotations

import asyncio
import queue
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.request import GenerateRequest
from disagg.errors import DisaggError, UsageError
from disagg.serving.defaultmodel import Say, resolve_model
from disagg.serving.localagents import AgentProc, make_token_file, start_local_agents
from disagg.serving.metrics import Metrics
from disagg.serving.request import build_request
from disagg.serving.router import Endpoint, Route, Router, StopGeneration
from disagg.serving.stops import StopMatcher


@dataclass
class Completion:
    text: str  # the answer: never the model's reasoning nor its tool-call markup
    token_ids: list[int]
    metrics: Metrics
    finish_reason: str  # "stop" (EOS or a stop sequence), "length", or "tool_calls"
    model: str
    reasoning: str = ""  # the model's private reasoning (harmony analysis, <think>)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments": {}}


@dataclass
class Chunk:
    text: str  # answer text
    done: bool = False
    completion: Completion | None = None
    reasoning: str = ""  # reasoning text, streamed apart from the answer


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
    ) -> Client:
        """Start a prefill and `n_decode` decode agents per model on this machine.

        `model`: a model dir, several (one pipeline each, named by the dir), or None
        for the embedded default. `prefill_model`: the prefill agent loads that dir
        instead (one model only); agents on different weights refuse to pair unless
        `allow_mixed`, and results then say weights: "mixed". close() stops the agents.
        """
        wanted = model if isinstance(model, list) else [model]
        if prefill_model is not None and len(wanted) != 1:
            raise UsageError("--prefill-model goes with exactly one --model")
        prefill_dir = resolve_model(prefill_model, say) if prefill_model is not None else None
        dirs = {}
        for m in wanted:
            path = resolve_model(m, say)
            dirs[path.name] = path
        pipelines, agents = [], []
        # One cluster: every local agent shares one fresh token.
        token_file, token = make_token_file(Path(tempfile.mkdtemp(prefix="disagg-local-")))
        try:
            for name, path in dirs.items():
                prefill, decodes = start_local_agents(
                    path,
                    n_decode=n_decode,
                    dtype=dtype,
                    token_file=token_file,
                    prefill_model_dir=prefill_dir,
                    decode_args=["--allow-mixed"] if allow_mixed else [],
                )
                agents += [prefill, *decodes]
                pipelines.append(
                    Route(
                        name,
                        [Endpoint(prefill.name, prefill.host, prefill.port, prefill.control_port)],
                        [Endpoint(d.name, d.host, d.port, d.control_port) for d in decodes],
                        # Both ends on this machine's loopback: no path to protect the
                        # K/V on, so no tags to pay for (a fleet pipeline's default: mac).
                        integrity="none",
                    )
                )
        except BaseException:
            for agent in agents:
                agent.stop()
            raise
        client = cls(router=Router(pipelines, token=token))
        client.agents = agents
        client.model_dirs = dirs
        return client

    def close(self) -> None:
        for agent in reversed(self.agents):
            agent.stop()
        self.agents = []

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
        **fields: Any,
    ) -> Completion | Iterator[Chunk]:
        """Text plus the seed's metrics, or with stream=True an iterator of chunks
        whose last one has done=True and the Completion.

        `request`: a `GenerateRequest`; or its fields as keywords (prompt= or
        messages=, max_tokens=, temperature=, top_p=, stop=, seed=, ...). Setting
        `cancel` stops decoding at the next token (a gateway's client hung up).
        """
        request = _request_from(request, fields)
        name = self.router.pipeline(model).name
        if stream:
            return self._stream(name, request, cancel)
        return self._run(name, request, lambda _chunk: None, cancel)

    def _run(
        self,
        model: str,
        req: GenerateRequest,
        emit: Callable[[Chunk], None],
        cancel: threading.Event | None = None,
    ) -> Completion:
        matcher = StopMatcher(req.stop)  # stop sequences end the answer, not the reasoning
        count = 0
        reasoning: list[str] = []

        def on_token(tok: dict[str, Any]) -> None:
            nonlocal count
            if cancel is not None and cancel.is_set():
                raise StopGeneration
            count += tok.get("id") is not None
            if tok.get("channel") == "reasoning":
                if tok.get("text"):
                    reasoning.append(tok["text"])
                    emit(Chunk("", reasoning=tok["text"]))
                return
            text = matcher.feed(tok.get("text") or "")
            if text:
                emit(Chunk(text))
            if matcher.hit:
                raise StopGeneration

        try:
            result = self.router.run(model, req, on_token=on_token)
        except StopGeneration:
            m = Metrics(completion_tokens=count)
            return Completion(matcher.text, [], m, "stop", model, "".join(reasoning))
        tail = matcher.flush()
        if tail:
            emit(Chunk(tail))
        m = result.metrics
        reason = m.finish_reason or ("length" if m.completion_tokens == req.max_tokens else "stop")
        return Completion(
            result.text, result.token_ids, m, reason, model, result.reasoning, result.tool_calls
        )

    def _stream(
        self,
        model: str,
        req: GenerateRequest,
        cancel: threading.Event | None = None,
    ) -> Iterator[Chunk]:
        q: queue.Queue[Chunk | BaseException] = queue.Queue()
        cancelled = cancel or threading.Event()

        def emit(chunk: Chunk) -> None:
            if cancelled.is_set():
                raise StopGeneration  # the consumer went away: stop decoding
            q.put(chunk)

        def work() -> None:
            try:
                done = self._run(model, req, emit, cancelled)
                q.put(Chunk("", done=True, completion=done))
            except BaseException as e:  # handed to the consumer's thread
                q.put(e)

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
        **fields: Any,
    ) -> Completion | AsyncIterator[Chunk]:
        """The async twin of generate: awaits a Completion, or gives an async iterator."""
        request = _request_from(request, fields)
        if not stream:
            result = await asyncio.to_thread(self.generate, request, model=model, cancel=cancel)
            assert isinstance(result, Completion)
            return result
        chunks = self.generate(request, model=model, stream=True, cancel=cancel)
        assert not isinstance(chunks, Completion)
        return _aiter(chunks)


def _request_from(request: GenerateRequest | None, fields: dict[str, Any]) -> GenerateRequest:
    """The Python API takes a request, or its fields as keywords."""
    if request is None:
        if ("prompt" in fields) == ("messages" in fields):
            raise UsageError("give exactly one of prompt= or messages=")
        return build_request(**fields)
    if fields:
        raise UsageError(f"give a request or its fields, not both: {', '.join(fields)}")
    return request


async def _aiter(chunks: Iterator[Chunk]) -> AsyncIterator[Chunk]:
    done = object()
    try:
        while True:
            item = await asyncio.to_thread(next, chunks, done)
            if item is done:
                return
            assert isinstance(item, Chunk)
            yield item
    finally:
        close = getattr(chunks, "close", None)
        if close:
            close()


__all__ = ["Chunk", "Client", "Completion", "DisaggError", "GenerateRequest", "Metrics"]

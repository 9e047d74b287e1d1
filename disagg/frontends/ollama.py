"""Ollama's API over a disagg Client, so Ollama clients (the `ollama` Python and JS
libraries, Open WebUI, editor plugins) use the cluster unchanged.

GET /api/tags, /api/ps, /api/version; POST /api/show, /api/generate, /api/chat
(NDJSON streaming by default, one object with `"stream": false`). Requests map
into the one request type (`agents.wire.request`) through `Client.generate`; the
response's durations (ns) and counts come from the agents' metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from agents.wire.frames import AuthError
from agents.wire.request import GenerateRequest
from disagg.api import Chunk, Client, Completion
from disagg.errors import DisaggError, Overloaded, UsageError
from disagg.frontends.guard import cache_salt, unless_gone
from disagg.serving.control import control_status
from disagg.serving.request import build_request

VERSION = "0.12.0"  # the Ollama API version whose shapes these are
# Ollama's defaults for a model without a Modelfile of its own.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9
UNLIMITED = 1 << 20  # num_predict < 0: until EOS; the decode agent caps it by the context
INFO_TTL_S = 30.0
NDJSON = "application/x-ndjson"


class OllamaError(Exception):
    """Answered as `{"error": message}` with this status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


class Options(BaseModel):
    # Ollama clients send many runner options (num_ctx, top_k, ...); the ones
    # that shape sampling here are mapped, the rest are accepted and ignored.
    model_config = ConfigDict(extra="allow")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = True
    options: Options | None = None
    keep_alive: str | float | None = None  # agents stay loaded; accepted
    format: str | dict[str, Any] | None = None  # "", "json", or a JSON Schema
    think: bool | Literal["low", "medium", "high"] | None = None


class GenerateBody(_Common):
    prompt: str | None = None
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None  # an assistant turn's reasoning
    tool_calls: list[dict[str, Any]] | None = None  # [{"function": {"name", "arguments"}}]
    tool_name: str | None = None  # a tool result: which function answered

    def as_request(self) -> dict[str, Any]:
        """This message as the one request type takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.thinking:
            out["thinking"] = self.thinking
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
            out["content"] = self.content or None
        if self.tool_name:
            out["name"] = self.tool_name
        return out


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # older clients


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: Any) -> int:
    return int(float(seconds) * 1e9) if isinstance(seconds, int | float) else 0


def resolve(client: Client, name: str) -> str:
    """The pipeline a name means, as `-m` resolves it (names and aliases); Ollama's
    implicit `:latest` tag is dropped when the bare name is served."""
    served = client.models()
    if name in served:
        return name
    if name.endswith(":latest") and name[: -len(":latest")] in served:
        return name[: -len(":latest")]
    raise OllamaError(404, f'model "{name}" not found; served: {", ".join(served) or "none"}')


class ModelInfo:
    """What the decode agents say about each model (architecture, context,
    dtype), fetched from their /status and kept for a short while."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self.lock = threading.Lock()

    def get(self, name: str) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            hit = self.cache.get(name)
        if hit and now - hit[0] < INFO_TTL_S:
            return hit[1]
        info: dict[str, Any] = {}
        router = self.client.router
        for ep in router.pipeline(name).decode:
            if ep.control_port is None:
                continue
            try:
                info = control_status(ep.host, ep.control_port, router.token, timeout_s=2.0)
                break
            except (OSError, ValueError, AuthError):
                continue
        with self.lock:
            self.cache[name] = (now, info)
        return info


def _details(info: dict[str, Any]) -> dict[str, Any]:
    fp = info.get("fingerprint") or {}
    arch = str(fp.get("architecture") or "")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": "",
        "quantization_level": str(fp.get("dtype") or "").upper(),
    }


def _context(info: dict[str, Any]) -> int | None:
    ctx = info.get("context")
    return int(ctx) if isinstance(ctx, int) else None


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's `format` as the request's response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "schema": fmt, "strict": True}
    raise OllamaError(400, f'format {fmt!r}: use "json" or a JSON Schema object')


def _sampling(body: _Common) -> dict[str, Any]:
    o = body.options or Options()
    num_predict = o.num_predict
    return {
        "temperature": DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
        "top_p": DEFAULT_TOP_P if o.top_p is None else o.top_p,
        "seed": o.seed,
        "stop": o.stop,
        "max_tokens": UNLIMITED if num_predict is None or num_predict < 0 else num_predict,
        "response_format": response_format(body.format),
        "think": body.think,
    }


def _request(body: _Common, inputs: dict[str, Any]) -> GenerateRequest:
    try:
        return build_request(**_sampling(body), **inputs)
    except UsageError as e:
        raise OllamaError(400, str(e)) from None


def generate_request(body: GenerateBody) -> GenerateRequest | None:
    """/api/generate's body as the one request; None for Ollama's "load the model"
    call (no prompt)."""
    if body.images:
        raise OllamaError(400, "images are not supported by disagg's text models")
    if not body.prompt and body.suffix is None:
        return None
    inputs = {"prompt": body.prompt or "", "raw": body.raw, "system": body.system}
    if body.suffix is not None:  # continue.dev's autocomplete: the PSM prompt, as is
        inputs.update(suffix=body.suffix, raw=True)
    return _request(body, inputs)


def chat_request(body: ChatBody) -> GenerateRequest | None:
    """/api/chat's body as the one request; None without messages (a load call)."""
    if any(m.images for m in body.messages):
        raise OllamaError(400, "images are not supported by disagg's text models")
    if not body.messages:
        return None
    inputs: dict[str, Any] = {"messages": [m.as_request() for m in body.messages]}
    if body.tools:
        inputs["tools"] = body.tools
    return _request(body, inputs)


def listed(name: str, about: dict[str, Any]) -> dict[str, Any]:
    """A model as /api/tags lists it."""
    entry = {"name": name, "model": name, "modified_at": _now(), "size": 0, "digest": ""}
    return {**entry, "details": _details(about)}


def running(name: str, about: dict[str, Any]) -> dict[str, Any]:
    """A model as /api/ps lists it: loaded until its agents stop."""
    return {
        "name": name,
        "model": name,
        "size": 0,
        "digest": "",
        "details": _details(about),
        "expires_at": "9999-12-31T23:59:59Z",
        "size_vram": 0,
        "context_length": _context(about),
    }


def show_model(name: str, about: dict[str, Any]) -> dict[str, Any]:
    """/api/show's answer for a served model, from its decode agent's /status."""
    fp = about.get("fingerprint") or {}
    arch = str(fp.get("architecture") or "unknown")
    model_info: dict[str, Any] = {"general.architecture": arch}
    for key, value in (
        ("context_length", _context(about)),
        ("block_count", fp.get("num_layers")),
        ("attention.head_count_kv", fp.get("num_kv_heads")),
        ("attention.key_length", fp.get("head_dim")),
    ):
        if value is not None:
            model_info[f"{arch}.{key}"] = value
    chat = about.get("chat")
    chat = chat if isinstance(chat, dict) else {}
    params = [f"temperature {DEFAULT_TEMPERATURE}", f"top_p {DEFAULT_TOP_P}"]
    if _context(about):
        params.insert(0, f"num_ctx {_context(about)}")
    params += [f"stop {json.dumps(s)}" for s in chat.get("stop") or [] if isinstance(s, str)]
    caps = chat.get("capabilities")
    return {
        "modelfile": f"# served by disagg: pipeline {name}\n",
        "parameters": "\n".join(params),
        "template": _template(chat),
        "details": _details(about),
        "model_info": model_info,
        "capabilities": caps if isinstance(caps, list) else ["completion"],
        "modified_at": _now(),
    }


def _template(chat: dict[str, Any]) -> str:
    """The model's chat template (Jinja, as its tokenizer has it). With FIM tokens
    it is wrapped in the fill-in-the-middle rule as Ollama writes it, so editors
    that look for `.Suffix` (continue.dev) know they may send one."""
    text = str(chat.get("template") or "")
    fim = chat.get("fim_tokens")
    if not (isinstance(fim, list) and len(fim) == 3 and all(isinstance(t, str) for t in fim)):
        return text
    pre, suf, mid = fim
    return (
        f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}"
        f"{{{{- else }}}}{text}{{{{- end }}}}"
    )


def _durations(c: Completion, t0: float) -> dict[str, Any]:
    m = c.metrics
    return {
        "total_duration": _ns(time.perf_counter() - t0),
        "load_duration": 0,  # agents keep their model loaded
        "prompt_eval_count": int(m.get("prompt_tokens") or 0),
        "prompt_eval_duration": _ns(m.get("ttft")),
        "eval_count": int(m.get("completion_tokens") or 0),
        "eval_duration": _ns(m.get("decode_time")),
    }


def routes(client: Client, workers: Executor | None = None) -> APIRouter:
    """Ollama's endpoints, for `gateway.create_app` to mount; requests run on
    `workers` (the gateway's, which may refuse: 503 with Retry-After)."""
    api = APIRouter()
    info = ModelInfo(client)

    async def describe(name: str) -> dict[str, Any]:
        return await asyncio.to_thread(info.get, name)

    @api.get("/", response_class=PlainTextResponse)
    @api.head("/", response_class=PlainTextResponse)
    async def alive() -> str:
        return "Ollama is running"  # what Ollama answers; clients probe it

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [listed(name, await describe(name)) for name in client.models()]}

    @api.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [running(name, await describe(name)) for name in client.models()]}

    @api.post("/api/show")
    async def show(body: ShowBody) -> dict[str, Any]:
        name = resolve(client, body.model or body.name or "")
        return show_model(name, await describe(name))

    async def answer(
        request: Request, body: _Common, kind: str, req: GenerateRequest | None
    ) -> Any:
        name = resolve(client, body.model)
        if req is not None:  # each API key its own prefix-cache tenant
            req = req.replace(cache_salt=cache_salt(request))
        t0 = time.perf_counter()
        head = {"model": body.model}
        if req is None:  # no prompt or messages: Ollama's "load the model" request
            done = {"created_at": _now(), "done": True, "done_reason": "load"}
            return {**head, **({"response": ""} if kind == "generate" else _msg("")), **done}
        try:
            if not body.stream:
                c = await unless_gone(
                    request,
                    lambda cancel: client.agenerate(
                        req, model=name, cancel=cancel, executor=workers
                    ),
                )
                if body.think is False:  # as Ollama: no thinking when it was turned off
                    c.reasoning = ""
                return _final(head, kind, c, t0, whole=True)
            cancel = threading.Event()
            chunks = await client.agenerate(
                req, model=name, stream=True, cancel=cancel, executor=workers
            )
        except UsageError as e:
            raise OllamaError(400, str(e)) from None
        except Overloaded as e:  # Ollama answers 503 when its queue is full
            raise OllamaError(503, str(e), {"Retry-After": str(e.retry_after_s)}) from None
        except DisaggError as e:
            raise OllamaError(500, str(e)) from None
        assert not isinstance(chunks, Completion)
        return StreamingResponse(
            _ndjson(head, kind, chunks, t0, cancel, body.think is not False),
            media_type=NDJSON,
            status_code=200,
        )

    @api.post("/api/generate", response_model=None)
    async def generate(request: Request, body: GenerateBody) -> Any:
        return await answer(request, body, "generate", generate_request(body))

    @api.post("/api/chat", response_model=None)
    async def chat(request: Request, body: ChatBody) -> Any:
        return await answer(request, body, "chat", chat_request(body))

    @api.api_route("/api/{what}", methods=["POST", "DELETE", "PUT"], include_in_schema=False)
    async def unsupported(what: str) -> Response:
        raise OllamaError(
            501 if what in ("pull", "push", "create", "copy", "delete", "embed") else 404,
            f"/api/{what} is not served by disagg: models are the inventory's pipelines",
        )

    return api


def _msg(
    text: str, thinking: str = "", calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:  # Ollama's shape: arguments as an object
        message["tool_calls"] = [
            {"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ]
    return {"message": message}


def _piece(kind: str, text: str, thinking: str = "") -> dict[str, Any]:
    if kind == "chat":
        return _msg(text, thinking)
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def _final(
    head: dict[str, Any], kind: str, c: Completion, t0: float, whole: bool
) -> dict[str, Any]:
    """The last object: the whole answer (`whole`, not streaming) or an empty piece."""
    if not whole:
        piece = _piece(kind, "")
    elif kind == "chat":
        piece = _msg(c.text, c.reasoning, c.tool_calls)
    else:
        piece = _piece(kind, c.text, c.reasoning)
    return {
        **head,
        "created_at": _now(),
        **piece,
        "done": True,
        # Ollama says "stop" after a tool call too; the calls themselves tell.
        "done_reason": "stop" if c.finish_reason == "tool_calls" else c.finish_reason,
        **_durations(c, t0),
    }


async def _ndjson(
    head: dict[str, Any],
    kind: str,
    chunks: AsyncIterator[Chunk],
    t0: float,
    cancel: threading.Event,
    thinking: bool = True,
) -> AsyncIterator[str]:
    def line(obj: dict[str, Any]) -> str:
        return json.dumps(obj) + "\n"

    try:
        async for chunk in chunks:
            if chunk.text or (chunk.reasoning and thinking):
                piece = _piece(kind, chunk.text, chunk.reasoning if thinking else "")
                yield line({**head, "created_at": _now(), **piece, "done": False})
            if chunk.done and chunk.completion is not None:
                c = chunk.completion
                if c.tool_calls and kind == "chat":  # as Ollama streams them: before done
                    calls = _msg("", "", c.tool_calls)
                    yield line({**head, "created_at": _now(), **calls, "done": False})
                yield line(_final(head, kind, c, t0, whole=False))
    except DisaggError as e:
        yield line({"error": str(e)})  # the ollama client raises ResponseError on it
    finally:
        cancel.set()  # a client that left mid-stream stops the decoding

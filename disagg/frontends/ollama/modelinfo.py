"""What Ollama's /api/tags, /api/ps and /api/show say about a served model, from
its decode agents' /status (disagg.frontends.agentinfo)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from disagg.api import Client
from disagg.frontends import maxtokens
from disagg.frontends.agentinfo import About
from disagg.frontends.ollama.types import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, OllamaError
from disagg_agents.wire.status import ChatFacts


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def resolve(client: Client, name: str) -> str:
    """The pipeline a name means, as `-m` resolves it (names and aliases); Ollama's
    implicit `:latest` tag is dropped when the bare name is served."""
    served = client.models()
    if name in served:
        return name
    if name.endswith(":latest") and name[: -len(":latest")] in served:
        return name[: -len(":latest")]
    raise OllamaError(404, f'model "{name}" not found; served: {", ".join(served) or "none"}')


def _details(about: About) -> dict[str, Any]:
    fp = about.status.fingerprint
    arch = str(fp.get("architecture") or "")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": "",
        "quantization_level": str(fp.get("dtype") or "").upper(),
    }


def _context(about: About) -> int | None:
    return about.status.context


def listed(name: str, about: About) -> dict[str, Any]:
    """A model as /api/tags lists it."""
    entry = {"name": name, "model": name, "modified_at": timestamp(), "size": 0, "digest": ""}
    return {**entry, "details": _details(about)}


def running(name: str, about: About) -> dict[str, Any]:
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


def show_model(name: str, about: About) -> dict[str, Any]:
    """/api/show's answer for a served model, from its decode agent's /status."""
    fp = about.status.fingerprint
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
    chat = about.status.chat or ChatFacts()
    if chat.tool_format is not None:  # template, harmony, generic or none
        model_info["disagg.tool_format"] = chat.tool_format
    params = [f"temperature {DEFAULT_TEMPERATURE}", f"top_p {DEFAULT_TOP_P}"]
    if maxtokens.default() is not None:  # the operator's default answer length
        params.append(f"num_predict {maxtokens.default()}")
    if _context(about):
        params.insert(0, f"num_ctx {_context(about)}")
    params += [f"stop {json.dumps(s)}" for s in chat.stop]
    caps = list(chat.capabilities) if chat.capabilities is not None else ["completion"]
    if about.embedding_only:  # an embedding pipeline: no chat, no generate
        caps = ["embedding"]
    return {
        "modelfile": f"# served by disagg: pipeline {name}\n",
        "parameters": "\n".join(params),
        "template": _template(chat),
        "details": _details(about),
        "model_info": model_info,
        "capabilities": caps,
        "modified_at": timestamp(),
    }


def _template(chat: ChatFacts) -> str:
    """The model's chat template (Jinja, as its tokenizer has it). With FIM tokens
    it is wrapped in the fill-in-the-middle rule as Ollama writes it, so editors
    that look for `.Suffix` (continue.dev) know they may send one."""
    text = chat.template or ""
    if chat.fim_tokens is None:
        return text
    pre, suf, mid = chat.fim_tokens
    return (
        f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}"
        f"{{{{- else }}}}{text}{{{{- end }}}}"
    )

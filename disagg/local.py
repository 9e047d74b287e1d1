"""`--local`: a prefill and a decode agent as processes on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents.models import UnsupportedModel, get_adapter, load_hf_config

from .defaultmodel import Say, ensure_default_model
from .errors import ModelError, UsageError
from .launcher import AgentProc


def resolve_model(model: str | None, say: Say) -> Path:
    """The model dir to use: --model PATH, checked before any agent starts, or the default."""
    if model is None:
        return ensure_default_model(say)
    path = Path(model).expanduser()
    try:
        get_adapter(load_hf_config(path)["model_type"])
    except UnsupportedModel as e:
        raise ModelError(f"--model {model}: {e}") from None
    return path.resolve()


def build_request(
    prompt: str | None = None,
    *,
    messages: list[dict[str, Any]] | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    system: str | None = None,
    raw: bool = False,
    prefill: AgentProc | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Check what can be checked here, so bad input never costs an agent start."""
    if messages is not None:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                for m in messages
            )
        ):
            raise UsageError("messages must be a non-empty list of {role, content} objects")
    elif prompt is None or not prompt.strip():
        raise UsageError('the prompt is empty: give some text, e.g. disagg generate --local "Hi"')
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise UsageError(f"--max-tokens (max_tokens) must be at least 1, got {max_tokens}")
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    req: dict[str, Any] = {
        "prompt": prompt,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "system": system,
        "raw": raw,
        **extra,
    }
    if prefill is not None:
        req["prefill"] = {"host": prefill.host, "port": prefill.port}
    return req

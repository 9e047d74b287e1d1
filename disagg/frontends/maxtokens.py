"""How long an answer may run when the client sets no limit: until the model
stops or its context is full (as OpenAI's and Ollama's servers do), unless the
operator set a default (`disagg serve --max-tokens N`). One gateway per process,
so the default is the process's."""

from __future__ import annotations

UNLIMITED = 1 << 20  # "until EOS": the decode agent caps it by the context left
_operator_default: int | None = None


def set_default(n: int | None) -> None:
    """The operator's default (None: to the context)."""
    global _operator_default
    if n is not None and n < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {n}")
    _operator_default = n


def default() -> int | None:
    """The operator's default, None when unset (shown by /api/show)."""
    return _operator_default


def resolve(asked: int | None) -> int:
    """The request's max_tokens: the client's, else the operator's, else UNLIMITED."""
    if asked is not None:
        return asked
    return _operator_default if _operator_default is not None else UNLIMITED

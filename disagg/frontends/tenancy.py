"""Which tenant (API key) a request belongs to, wherever the request runs.

The guard sets it for each request it lets in; the worker pool carries it onto
the request's thread (contextvars), so the request log records whose request it
is and admission counts each tenant's share. A tenant is its key's SHA-256
digest, never the key; None when the gateway wants no key (or the caller came
in with the web view's cookie, which only the operator holds).
"""

from __future__ import annotations

import re
from contextvars import ContextVar, Token
from typing import Any

# Where the guard leaves what it found, in the request's scope["state"].
TENANT = "disagg_tenant"
OPERATOR = "disagg_operator"

_current: ContextVar[bytes | None] = ContextVar("disagg_tenant", default=None)
# Whether the request running here is the operator's (outside the guard: yes).
_operator: ContextVar[bool] = ContextVar("disagg_operator", default=True)


def current() -> bytes | None:
    """The tenant of the request running here (None: no key)."""
    return _current.get()


def enter(tenant: bytes | None, operator: bool = True) -> object:
    """Set the tenant (and whether it is the operator) for the rest of this context;
    `leave` undoes it."""
    return _current.set(tenant), _operator.set(operator)


def leave(token: object) -> None:
    marks: tuple[Token[bytes | None], Token[bool]] = token  # type: ignore[assignment]
    _operator.reset(marks[1])
    _current.reset(marks[0])


def operator_now() -> bool:
    """Whether the request running here is the operator's (see is_operator)."""
    return _operator.get()


def _state(request: Any) -> dict[str, Any]:
    state = request.scope.get("state")
    return state if isinstance(state, dict) else {}


def is_operator(request: Any) -> bool:
    """The operator sees the fleet (agents, addresses) and every tenant's requests:
    the first key of the gateway's keys (its web view cookie too), or every caller
    of a gateway that wants no key. Other keys see their own requests only."""
    return _state(request).get(OPERATOR) is True


def tenant_of(request: Any) -> bytes | None:
    """The caller's tenant (its key's digest), None without a key."""
    got = _state(request).get(TENANT)
    return got if isinstance(got, bytes) else None


def label(tenant: bytes | None) -> str | None:
    """A short name for a tenant the operator may see (never the key)."""
    return None if tenant is None else "key-" + tenant.hex()[:8]


# An agent's address in an error's text: an IPv4 or [IPv6] address, or host:port.
ADDRESS = re.compile(
    r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b|\[[0-9A-Fa-f:.]+\](?::\d{1,5})?"
    r"|\b[\w.-]*[A-Za-z][\w.-]*:\d{2,5}\b"
)


def hide_addresses(text: str) -> str:
    """`text` without agents' addresses, for a tenant who is not the operator."""
    return ADDRESS.sub("(an agent)", text)


# A Python exception's text inside a message (an agent's `decode_failed: ValueError:
# ...`, a `KeyError('x')`): the code's insides, not ours to show a tenant.
EXCEPTION = re.compile(
    r"\b(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Panic\w*|Warning)"
    r"(?::[^\n]*|\([^\n]*)|\bTraceback \(most recent call last\)[\s\S]*"
)
INTERNAL = "an internal error (the operator's logs have the cause)"


def for_tenant(text: str) -> str:
    """`text` as a tenant who is not the operator may read it: no agents' addresses
    and no exception text (messages of our own are left as they are)."""
    return EXCEPTION.sub(INTERNAL, hide_addresses(text))

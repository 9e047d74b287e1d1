"""What a tenant (a key other than the operator's) may read, as units over the
gateway's own guard and refusals: the internals header is the operator's only, an
error's exception text becomes a message of ours, and the tenant tag agents see
is neither the key nor the caller's cache_salt."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from disagg.errors import AgentError, DisaggError, UsageError
from disagg.frontends import tenancy
from disagg.frontends.core import from_disagg
from disagg.frontends.guard import Guard, cache_salt, tenant_tag, wants_internals

OPERATOR_KEY, KEY_A, KEY_B = "op-" + "o" * 24, "tenant-a-" + "a" * 24, "tenant-b-" + "b" * 24


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never reached here
    raise AssertionError


def request_of(guard: Guard, key: str, internals: bool = True) -> Request:
    """A request to /v1/completions as the guard let it in (its state filled)."""
    headers = [(b"authorization", f"Bearer {key}".encode())]
    if internals:
        headers.append((b"x-disagg-internals", b"1"))
    scope: dict[str, Any] = {"type": "http", "path": "/v1/completions", "headers": headers}
    assert guard.authorized(scope)
    return Request(scope)


def test_the_internals_header_is_honoured_for_the_operators_key_only() -> None:
    guard = Guard(_app, [OPERATOR_KEY, KEY_A, KEY_B])
    assert wants_internals(request_of(guard, OPERATOR_KEY))
    assert not wants_internals(request_of(guard, OPERATOR_KEY, internals=False))
    assert not wants_internals(request_of(guard, KEY_A))  # a tenant's header: ignored
    assert not wants_internals(request_of(guard, KEY_B))


def test_the_tenant_tag_is_per_key_and_not_the_callers_salt() -> None:
    guard = Guard(_app, [OPERATOR_KEY, KEY_A, KEY_B])
    a, b = request_of(guard, KEY_A), request_of(guard, KEY_B)
    tag_a, tag_b = tenant_tag(a), tenant_tag(b)
    assert tag_a and tag_b and tag_a != tag_b and tag_a == tenant_tag(request_of(guard, KEY_A))
    assert KEY_A not in tag_a and tag_a not in (cache_salt(a), cache_salt(a, "shared"))
    # Two keys that pass the same cache_salt share K/V, but stay two tenants.
    assert cache_salt(a, "shared") == cache_salt(b, "shared")


def as_tenant(e: DisaggError, operator: bool = False) -> Any:
    mark = tenancy.enter(b"a" * 32, operator=operator)
    try:
        return from_disagg(e)
    finally:
        tenancy.leave(mark)


def test_a_tenant_reads_our_messages_not_exception_text() -> None:
    crashed = AgentError(
        "decode agent 10.0.0.7:7001: decode_failed: ValueError: operands could not be "
        "broadcast together with shapes (1,5) (3,)"
    )
    seen = as_tenant(crashed)
    assert seen.status == 503 and seen.code == "agent_unavailable"
    for inside in ("ValueError", "operands", "10.0.0.7", "7001"):
        assert inside not in seen.message, seen.message
    assert "decode_failed" in seen.message and "internal error" in seen.message
    assert as_tenant(crashed, operator=True).message == str(crashed)  # the operator's: all
    odd = as_tenant(DisaggError("KeyError('layers')"))
    assert odd.status == 500 and odd.code == "internal_error" and "KeyError" not in odd.message
    ours = UsageError("max_tokens must be at least 1, got 0", param="max_tokens")
    assert as_tenant(ours).message == str(ours) and as_tenant(ours).param == "max_tokens"

"""The one request type (`disagg_agents.wire.request.GenerateRequest`) as the control plane
builds it: input errors become `UsageError`s naming the field, so bad input never
costs an agent start."""

from __future__ import annotations

from typing import Any

from disagg.errors import UsageError
from disagg_agents.wire.request import GenerateRequest, RequestError


def build_request(**fields: Any) -> GenerateRequest:
    """A checked request from JSON-like fields (unknown ones refused)."""
    try:
        return GenerateRequest.from_dict(fields)
    except RequestError as e:
        raise UsageError(str(e), param=e.field) from None


def with_fields(request: GenerateRequest, **changes: Any) -> GenerateRequest:
    """`request` with `changes` applied, checked as any request."""
    try:
        return request.replace(**changes)
    except RequestError as e:
        raise UsageError(str(e), param=e.field) from None

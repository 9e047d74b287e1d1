"""Requests from the CLI, the Python API, batch files and the gateway, built as
the one request type the decode agent checks (`agents.request`)."""

from __future__ import annotations

from typing import Any

from agents.request import GenerateRequest, RequestError
from disagg.errors import UsageError
from disagg.serving.localagents import AgentProc


def build_request(
    prompt: str | None = None, *, prefill_agent: AgentProc | None = None, **fields: Any
) -> dict[str, Any]:
    """The GENERATE frame's JSON for these fields, checked here so bad input
    never costs an agent start. `prefill_agent`: prefill from that local agent."""
    if prefill_agent is not None:
        fields["prefill"] = {"hosts": [prefill_agent.host], "port": prefill_agent.port}
    try:
        return GenerateRequest.from_dict({"prompt": prompt, **fields}).to_wire()
    except RequestError as e:
        raise UsageError(str(e), param=e.field) from None

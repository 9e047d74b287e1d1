"""A request on one local prefill/decode pair with the prompt's K/V forced to come
from the prefill agent: the one way `disagg verify` and the benches run it."""

from __future__ import annotations

from collections.abc import Callable

from disagg.errors import AgentError
from disagg.serving import wireclient
from disagg.serving.completion import Completion
from disagg.serving.localagents import AgentProc
from disagg.serving.router import Endpoint
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest


def run_remote(
    prefill: AgentProc,
    decode: AgentProc,
    request: GenerateRequest,
    *,
    on_token: Callable[[TokenEvent], None] | None = None,
    timeout_s: float = 900.0,
    prefill_timeout_s: float | None = None,
    require: bool = True,
) -> Completion:
    """Run `request` on `decode` with placement "remote" and `prefill` as its target.
    The decode agent still falls back to a local prefill if the prefill agent fails;
    with `require` that is an AgentError, else the result says so in its metrics.
    `prefill_timeout_s`: how long the decode agent waits on the prefill agent."""
    # On loopback there is no path for tags to protect (as Client.local's pairs).
    integrity = "none" if prefill.host in ("127.0.0.1", "::1", "localhost") else "mac"
    target = Endpoint(prefill.name, prefill.host, prefill.port).prefill_target(integrity=integrity)
    forced = request.replace(prefill=target, placement="remote")
    result = wireclient.generate(
        decode.host, decode.port, forced, on_token=on_token, timeout_s=timeout_s, token=decode.token
    )
    if require and result.metrics.method != "disaggregated":
        raise AgentError(
            "the request was not disaggregated: "
            f"{result.metrics.fallback_reason or result.metrics.method}"
        )
    return result

"""A prefill agent whose K/V stream is stretched, so a test's fault (a kill, a cut
link, a drain) lands mid-stream. Test-only: the shipped agent has no such flag.

`python -m tests.slowprefill --layer-delay S <the agent's flags>` runs the real
prefill agent (`disagg_agents.prefill`) with an engine that sleeps S seconds after each
layer's K/V is handed on, but the last; tests start it with `slow_prefill(S)`:
`start_local_agents(model, **slow_prefill(0.4))`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

FLAG = "--layer-delay"


def slow_prefill(layer_delay_s: float, *args: str) -> dict[str, Any]:
    """Keywords for `start_local_agents` / `agent_pair`: the prefill agent runs from
    this module, each layer `layer_delay_s` late; `args`: more prefill flags."""
    return {"prefill_module": __name__, "prefill_args": [FLAG, str(layer_delay_s), *args]}


# A slow set three modules share (test_deadlines, test_failover, test_gone_clients): a
# prefill agent 0.8 s late per layer (>= 2.4 s a prompt, past test_deadlines' 2 s
# timeout) and four decode agents of one batch slot each (test_deadlines uses two).
# test_failover's set of its own takes over the idle pooled one instead of starting
# another.
SLOW_LAYER_S = 0.8
SLOW_SET: dict[str, Any] = {
    "n_decode": 4,
    **slow_prefill(SLOW_LAYER_S),
    "decode_args": ["--max-batch", "1"],
}


def main() -> None:
    from disagg_agents.prefill import agent
    from disagg_agents.wire.kvcodec import LayerKV

    argv = sys.argv[1:]
    at = argv.index(FLAG)
    delay_s = float(argv[at + 1])
    sys.argv = [sys.argv[0], *argv[:at], *argv[at + 2 :]]

    class SlowEngine(agent.PrefillEngine):
        def prefill(
            self, token_ids: list[int], on_layer: Callable[[LayerKV], None], *a: Any, **kw: Any
        ) -> Any:
            last = len(self.layers) - 1

            def late(kv: LayerKV) -> None:
                on_layer(kv)  # on the forward pass's thread: the next layer waits
                if kv.layer != last:
                    time.sleep(delay_s)

            return super().prefill(token_ids, late, *a, **kw)

    agent.PrefillEngine = SlowEngine  # type: ignore[misc]  # what agent.main() builds
    agent.main()


if __name__ == "__main__":
    main()

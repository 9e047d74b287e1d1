"""disagg: disaggregated LLM inference across heterogeneous machines (control plane).

from disagg import Client
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Client", "Completion", "Chunk", "DisaggError", "GenerateRequest", "Metrics"]


def __getattr__(name: str) -> Any:
    # Lazy: `import disagg` stays cheap for the CLI's --help and for agents' tooling.
    if name in ("Client", "Completion", "Chunk", "GenerateRequest", "Metrics"):
        from disagg import api

        return getattr(api, name)
    if name == "DisaggError":
        from disagg.errors import DisaggError

        return DisaggError
    raise AttributeError(name)

"""disagg: disaggregated LLM inference across heterogeneous machines (control plane)."""

__version__ = "0.1.0"

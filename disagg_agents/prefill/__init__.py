"""The prefill agent (torch): its engine, the layer sender, and the fair queue.
Run: `python -m disagg_agents.prefill`."""

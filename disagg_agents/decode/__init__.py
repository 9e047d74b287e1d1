"""The decode agent (mlx): its engine and loop, batch rows, placement, keepalive,
the K/V receive into mlx caches, and grammars. Run: `python -m disagg_agents.decode`."""

"""The decode agent (mlx): its engine and loop, a request's stages (prompt, kvsource,
firsttoken, stream, events) over one Job, batch rows, placement, keepalive, the K/V
receive into mlx caches, and grammars. Run: `python -m disagg_agents.decode`."""

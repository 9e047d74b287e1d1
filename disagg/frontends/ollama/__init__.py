"""Ollama's API under /api: request shapes (`types`), what the agents say about a
model (`modelinfo`), and the routes (`routes`), mounted by `disagg.frontends.app`."""

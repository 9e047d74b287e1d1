"""OpenAI's Responses API (`POST /v1/responses`), stateless, as Codex speaks it."""

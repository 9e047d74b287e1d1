"""Anthropic's Messages API (`POST /v1/messages`), as Claude Code speaks it."""

"""JSON Schema rewrites shared by the grammars of structured outputs and of tool calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def closed(schema: Any) -> Any:
    """`schema` with objects that list properties closed to others unless they say
    so (`additionalProperties` left out means false), as Ollama's grammars and
    OpenAI's strict mode have it: otherwise a model may add keys without end."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
            out[key] = {name: closed(sub) for name, sub in value.items()}  # names, not a schema
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value  # values, not schemas
        else:
            out[key] = closed(value)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out

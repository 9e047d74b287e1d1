"""How big a request's JSON Schemas may be (response_format and tools' parameters).

A grammar's compile time grows faster than its size (one tool of 2,000 properties
compiles in ~0.7 s here, 10,000 in ~45 s), its cache entry by tens of MB, and a
schema nested deeper than the compiler's recursion limit fails inside it. So
every schema is measured here, on the gateway and again on the decode agent,
before anything compiles it: nesting, characters, property names and enum
members, each refused with one line naming the limit. Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

SCHEMA_MAX_CHARS = 65536  # one schema (a response_format's, or one tool's parameters), as JSON
TOOLS_MAX_CHARS = 131072  # all tools' parameters together, as JSON
SCHEMA_MAX_DEPTH = 48  # nested JSON objects/arrays in one schema (the compiler's limit is ~120)
PROPERTIES_MAX = 2048  # property names across all of a request's schemas
ENUM_MAX = 2048  # enum members across all of a request's schemas


class SchemaTooBig(ValueError):
    """A schema over one of the limits; `field` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def shape(schema: Any) -> tuple[int, int, int]:
    """(JSON nesting depth, property names, enum members) of `schema`, without
    recursion (the schema may be nested far deeper than Python's stack)."""
    depth = properties = enums = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, Mapping):
            depth = max(depth, level)
            for key, value in node.items():
                if key in ("properties", "patternProperties") and isinstance(value, Mapping):
                    properties += len(value)
                elif key == "enum" and isinstance(value, list):
                    enums += len(value)
                if isinstance(value, Mapping | list):
                    stack.append((value, level + 1))
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((item, level + 1) for item in node if isinstance(item, Mapping | list))
    return depth, properties, enums


def _chars(schema: Any, field: str) -> int:
    try:
        return len(json.dumps(schema, separators=(",", ":")))
    except (RecursionError, ValueError, TypeError) as e:
        raise SchemaTooBig(field, f"{field}: not a JSON Schema ({type(e).__name__})") from None


def check_schemas(response_schema: Any, tools: Iterable[tuple[str, Any]]) -> None:
    """Raise SchemaTooBig when the request's schemas are over a limit.

    response_schema: the response_format's schema (None: none).
    tools: (name, parameters) of each tool.
    """
    named: list[tuple[str, str, Any]] = []
    if response_schema is not None:
        named.append(("response_format", "the response_format schema", response_schema))
    named += [("tools", f"tool {name}'s parameters", params) for name, params in tools]
    # Depth first: json.dumps of a schema thousands deep would itself recurse.
    total_props = total_enums = tools_chars = 0
    for field, what, schema in named:
        depth, props, enums = shape(schema)
        if depth > SCHEMA_MAX_DEPTH:
            raise SchemaTooBig(
                field, f"{what}: {depth} levels of nesting; at most {SCHEMA_MAX_DEPTH}"
            )
        chars = _chars(schema, field)
        if chars > SCHEMA_MAX_CHARS:
            raise SchemaTooBig(
                field, f"{what}: {chars} characters of JSON; at most {SCHEMA_MAX_CHARS}"
            )
        if field == "tools":
            tools_chars += chars
        total_props += props
        total_enums += enums
        if tools_chars > TOOLS_MAX_CHARS:
            raise SchemaTooBig(
                "tools", f"the tools' parameters are over {TOOLS_MAX_CHARS} characters of JSON"
            )
        if total_props > PROPERTIES_MAX:
            raise SchemaTooBig(
                field, f"the request's schemas name over {PROPERTIES_MAX} properties in all"
            )
        if total_enums > ENUM_MAX:
            raise SchemaTooBig(
                field, f"the request's schemas list over {ENUM_MAX} enum members in all"
            )

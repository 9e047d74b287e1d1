"""Qwen3-Coder's tool calls, read as the best parsers read them:
`<function=NAME><parameter=ARG>value</parameter>…</function>`, values typed by
the tool's parameter schema.

The model drops closing tags on long calls (a file's whole text in a
parameter): a parameter ends at its `</parameter>`, else at the next
`<parameter=`, `</function>` or the end; a function at its `</function>` or the
end. A value that does not convert to its schema's type is kept as the string
the model wrote: the call is still the call (vLLM and Ollama recover these too).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any

FUNCTION, PARAMETER = "<function=", "<parameter="
FUNCTION_END, PARAMETER_END = "</function>", "</parameter>"
_NAME = re.compile(r"\s*([^\s<>]+)\s*>?")
_INTS = ("int", "uint", "long", "short", "unsigned")
_STRINGS = {"string", "str", "text", "varchar", "char", "enum"}
_BOOLS = {"boolean", "bool", "binary"}


def parse_call(body: str, tools: list[dict[str, Any]] | None) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of the first function in `body`; None without one."""
    start = body.find(FUNCTION)
    named = _NAME.match(body, start + len(FUNCTION)) if start >= 0 else None
    if named is None:
        return None
    name = named.group(1)
    rest = body[named.end() :]
    end = rest.find(FUNCTION_END)
    rest = rest if end < 0 else rest[:end]
    props = _properties(name, tools)
    args: dict[str, Any] = {}
    at = rest.find(PARAMETER)
    while at >= 0:
        arg = _NAME.match(rest, at + len(PARAMETER))
        if arg is None:
            break
        value_at = arg.end()
        close = rest.find(PARAMETER_END, value_at)
        following = rest.find(PARAMETER, value_at)
        if close >= 0 and (following < 0 or close < following):
            value_end, at = close, rest.find(PARAMETER, close)
        else:  # no </parameter>: the value runs to the next parameter or the end
            value_end = following if following >= 0 else len(rest)
            at = following
        value = rest[value_at:value_end]
        value = value.removeprefix("\n").removesuffix("\n")
        args[arg.group(1)] = convert(value, props.get(arg.group(1)))
    return name, args


def _properties(name: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            return dict(props) if isinstance(props, Mapping) else {}
    return {}


def _type_of(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):  # ["integer", "null"]: the type that is not null
        kind = next((k for k in kind if k != "null"), None)
    return str(kind).strip().lower() if kind is not None else None


def convert(value: str, schema: Any) -> Any:
    """`value` as its schema's type (mlx-lm's rules), or the string itself when
    it does not convert."""
    if value.lower() == "null":
        return None
    if not isinstance(schema, Mapping):
        return value
    kind = _type_of(schema)
    if kind is None:
        found = _json(value)
        return found if isinstance(found, (dict, list)) else value
    if kind in _STRINGS:
        return value
    if kind.startswith(_INTS) or kind.startswith(("num", "float")):
        if re.fullmatch(r"\s*-?\d+\s*", value):
            return int(value)  # exact, however long
        try:
            number = float(value)
        except ValueError:
            return value
        if number.is_integer():
            return int(number)
        return number if math.isfinite(number) and not kind.startswith(_INTS) else value
    if kind in _BOOLS:
        low = value.strip().lower()
        return {"true": True, "false": False}.get(low, value)
    found = _json(value)
    if found is not None:
        return found
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _json(value: str) -> Any:
    try:
        return json.loads(value, strict=False)
    except (json.JSONDecodeError, RecursionError):
        return None

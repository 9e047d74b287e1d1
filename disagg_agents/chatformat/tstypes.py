"""Tool definitions as harmony shows them to gpt-oss: a TypeScript-style
`namespace functions`, each function's JSON Schema as a type. Written after
openai-harmony's renderer, quirks included (the model was trained on them):
nested objects indent their fields but not their brace, integers are numbers,
string defaults are quoted unless the property is an enum."""

from __future__ import annotations

import json
from typing import Any


def tools_section(tools: list[tuple[str, str, Any]]) -> str:
    """`# Tools` for (name, description, parameters schema or None) functions."""
    lines = ["## functions\n", "namespace functions {\n"]
    for name, description, params in tools:
        lines += [f"// {line}" for line in rust_lines(description)]
        if params is None:
            lines.append(f"type {name} = () => any;\n")
        else:
            lines.append(f"type {name} = (_: {ts_type(params, '')}) => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def rust_lines(text: str) -> list[str]:
    """Lines as Rust's `str::lines` gives them: split at \\n, a trailing \\r
    dropped, no empty last line after a final newline."""
    if not text:
        return []
    parts = text.split("\n")
    if text.endswith("\n"):
        parts.pop()
    return [p.removesuffix("\r") for p in parts]


def _json(value: Any) -> str:
    """serde_json's compact text of a value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _get(schema: Any, key: str) -> Any:
    return schema.get(key) if isinstance(schema, dict) else None


def _is_enum(schema: Any) -> bool:
    values = _get(schema, "enum")
    return isinstance(values, list) and bool(values)


def _nullable(variant: Any, text: str) -> str:
    if _get(variant, "nullable") is True and "null" not in text:
        return f"{text} | null"
    return text


def _default(schema: Any, quote_enum: bool) -> str:
    """`default: …` of a schema that has one. quote_enum: an enum's string
    default still as JSON (the top-level oneOf case), else bare."""
    value = schema["default"]
    if isinstance(value, str) and not _is_enum(schema):
        return f'default: "{value}"'
    if isinstance(value, str) and not quote_enum:
        return f"default: {value}"
    return f"default: {_json(value)}"


def ts_type(schema: Any, indent: str) -> str:
    """A JSON Schema as a TypeScript type."""
    one_of = _get(schema, "oneOf")
    if isinstance(one_of, list):
        return _one_of(one_of, indent)
    kind = _get(schema, "type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = _get(schema, "enum")
        words = [f'"{v}"' for v in values if isinstance(v, str)] if isinstance(values, list) else []
        return " | ".join(words) if words else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        if "items" in schema:
            return f"{ts_type(schema['items'], indent)}[]"
        return "Array<any>"
    return "any"


def _one_of(variants: list[Any], indent: str) -> str:
    out = ""
    for variant in variants:
        out += f"\n{indent} | " + _nullable(variant, ts_type(variant, indent + "   "))
        notes = []
        if isinstance(_get(variant, "description"), str):
            notes.append(variant["description"])
        if isinstance(variant, dict) and "default" in variant:
            notes.append(_default(variant, quote_enum=True))
        if notes:
            out += " // " + " ".join(notes)
    return out


def _object(schema: dict[str, Any], indent: str) -> str:
    out = ""
    if isinstance(schema.get("description"), str):
        out += f"{indent}// {schema['description']}\n"
    out += "{\n"
    props = schema.get("properties")
    if isinstance(props, dict):
        req = schema.get("required")
        required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
        for key, val in props.items():
            opt = "" if key in required else "?"
            out += _comments(val, indent)
            one_of = _get(val, "oneOf")
            if isinstance(one_of, list):
                out += _property_one_of(key, opt, val, one_of, indent)
                continue
            out += f"{indent}{key}{opt}: " + _nullable(val, ts_type(val, indent + "    ")) + ","
            if one_of is None and isinstance(val, dict) and "default" in val:
                out += " // " + _default(val, quote_enum=False)
            out += "\n"
    return out + f"{indent}}}"


def _comments(val: Any, indent: str) -> str:
    """A property's title, description (unless a oneOf shows it) and examples."""
    out = ""
    if isinstance(_get(val, "title"), str):
        out += f"{indent}// {val['title']}\n{indent}//\n"
    if _get(val, "oneOf") is None and isinstance(_get(val, "description"), str):
        out += f"{indent}// {val['description']}\n"
    examples = _get(val, "examples")
    if isinstance(examples, list) and examples:
        out += f"{indent}// Examples:\n"
        out += "".join(f'{indent}// - "{ex}"\n' for ex in examples if isinstance(ex, str))
    return out


def _property_one_of(key: str, opt: str, val: Any, variants: list[Any], indent: str) -> str:
    desc = val.get("description") if isinstance(val.get("description"), str) else None
    first = _get(variants[0], "description") if variants else None
    above = desc is not None and first != desc
    out = f"{indent}// {desc}\n" if above else ""
    if "default" in val:
        out += f"{indent}// {_default(val, quote_enum=False)}\n"
    out += f"{indent}{key}{opt}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | " + _nullable(variant, ts_type(variant, indent + "   "))
        notes = []
        vdesc = _get(variant, "description")
        if not (i == 0 and above) and isinstance(vdesc, str) and vdesc != desc:
            notes.append(vdesc)
        if isinstance(variant, dict) and "default" in variant:
            notes.append(_default(variant, quote_enum=False))
        if notes:
            out += " // " + " ".join(notes)
        out += "\n"
    return out + f"{indent},\n"

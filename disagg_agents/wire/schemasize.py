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
import re
from collections.abc import Iterable, Mapping
from typing import Any

SCHEMA_MAX_CHARS = 65536  # one schema (a response_format's, or one tool's parameters), as JSON
TOOLS_MAX_CHARS = 131072  # all tools' parameters together, as JSON
SCHEMA_MAX_DEPTH = 48  # nested JSON objects/arrays in one schema (the compiler's limit is ~120)
PROPERTIES_MAX = 2048  # property names across all of a request's schemas
ENUM_MAX = 2048  # enum members across all of a request's schemas
# The compiler recurses along references: a chain of 3,000 Lark rules or of ~2,000
# `$ref`s overflows its stack (SIGSEGV, the whole process). Bounds far below that.
REF_CHAIN_MAX = 64  # `$ref` hops one after another (a cycle counts every member)
LARK_DEPTH_MAX = 200  # Lark rules (and terminals) each naming the next
LARK_RULES_MAX = 2048  # rules and terminals in one grammar
LARK_ALTERNATIVES_MAX = 8192  # `|` alternatives in one grammar


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
        chain = ref_chain(schema)
        if chain > REF_CHAIN_MAX:
            raise SchemaTooBig(
                field, f"{what}: $ref chains {chain} definitions deep; at most {REF_CHAIN_MAX}"
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


def _refs(node: Any) -> set[str]:
    """The local `$ref`s ("#/...") anywhere inside `node`, without recursion."""
    out: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Mapping):
            ref = n.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out.add(ref)
            stack.extend(v for v in n.values() if isinstance(v, Mapping | list))
        elif isinstance(n, list):
            stack.extend(v for v in n if isinstance(v, Mapping | list))
    return out


def ref_chain(schema: Any) -> int:
    """The longest run of `$ref` hops through `schema`'s definitions ($defs,
    definitions): each definition a node, an edge to every definition it refers
    to; a cycle's members all count (a conservative bound, never recursion)."""
    if not isinstance(schema, Mapping):
        return 0
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        table = schema.get(key)
        if isinstance(table, Mapping):
            defs.update({f"#/{key}/{name}": value for name, value in table.items()})
    edges = {name: [r for r in _refs(body) if r in defs] for name, body in defs.items()}
    # Every definition a root: one the schema never names may still be compiled.
    return longest_path(edges, list(edges))


def longest_path(edges: Mapping[str, list[str]], roots: Iterable[str]) -> int:
    """Nodes on the longest path from `roots`, each strongly connected component
    weighing its size (Tarjan's, iterative: the graph may be thousands deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    sizes: list[int] = []
    best: list[int] = []  # per component: nodes on its longest path onward
    on_stack: list[str] = []
    for root in roots:
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                on_stack.append(node)
            nexts = edges.get(node, [])
            if i < len(nexts):
                work.append((node, i + 1))
                nxt = nexts[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt not in comp:
                    low[node] = min(low[node], index[nxt])
                continue
            for nxt in nexts:
                if nxt in comp or nxt not in index:
                    continue
                low[node] = min(low[node], low[nxt])
            if low[node] == index[node]:  # a component closes: its members, then its depth
                members = []
                while True:
                    m = on_stack.pop()
                    comp[m] = len(sizes)
                    members.append(m)
                    if m == node:
                        break
                onward = [
                    best[comp[n]]
                    for m in members
                    for n in edges.get(m, [])
                    if comp.get(n, -1) != len(sizes) and n in comp
                ]
                sizes.append(len(members))
                best.append(len(members) + max(onward, default=0))
    return max(best, default=0)


_LARK_SKIP = re.compile(
    r'"(?:\\.|[^"\\])*"i?'  # string literals
    r"|/(?:\\.|[^/\\\n])+/[imsx]*"  # regexes
    r"|//[^\n]*"  # comments
    r"|<\|[^|>]*\|>|<\[[^\]]*\]>"  # special tokens by name or id
    r"|\[[^\]]*\]"  # [max_tokens=N] and the like
)
_LARK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LARK_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*(?:\{[^}]*\})?\s*:", re.M)


def lark_shape(text: str) -> tuple[int, int, int]:
    """(rules and terminals, `|` alternatives, longest chain of references) of a
    Lark grammar, read without compiling it. Inline `%json {...}` bodies are
    skipped; their `$ref`s are the compile check's to catch."""
    body = _without_json(text)
    heads = list(_LARK_RULE.finditer(body))
    edges: dict[str, list[str]] = {}
    alternatives = 0
    for k, head in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(body)
        rhs = _LARK_SKIP.sub(" ", body[head.end() : end])
        alternatives += rhs.count("|") + 1
        edges.setdefault(head.group(1), []).extend(_LARK_NAME.findall(rhs))
    edges = {n: [m for m in dict.fromkeys(refs) if m in edges] for n, refs in edges.items()}
    return len(edges), alternatives, longest_path(edges, list(edges))


def _without_json(text: str) -> str:
    """`text` with each `%json {...}` body blanked (balanced braces, strings aware)."""
    out, i = [], 0
    while (at := text.find("%json", i)) >= 0:
        out.append(text[i:at])
        j = text.find("{", at)
        if j < 0:
            return "".join(out) + text[at:]
        depth, quoted, k = 0, False, j
        while k < len(text):
            c = text[k]
            if quoted:
                k += 1 if c == "\\" else 0
                quoted = c != '"'
            elif c == '"':
                quoted = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        i = k + 1
    return "".join(out) + text[i:]


def check_lark(text: str, field: str, what: str) -> None:
    """Raise SchemaTooBig when a Lark grammar is over a limit a compile could not survive."""
    rules, alternatives, depth = lark_shape(text)
    if depth > LARK_DEPTH_MAX:
        raise SchemaTooBig(
            field, f"{what}: rules reference each other {depth} deep; at most {LARK_DEPTH_MAX}"
        )
    if rules > LARK_RULES_MAX:
        raise SchemaTooBig(field, f"{what}: {rules} rules; at most {LARK_RULES_MAX}")
    if alternatives > LARK_ALTERNATIVES_MAX:
        raise SchemaTooBig(
            field, f"{what}: {alternatives} alternatives; at most {LARK_ALTERNATIVES_MAX}"
        )

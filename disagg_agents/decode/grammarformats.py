"""Grammars (llguidance's lark) for what a chat format wraps around JSON: a
harmony final message after bounded reasoning, and forced tool calls in each
format's markup. The format kind is given by the caller, never guessed here.

Special tokens are written `<|name|>` (llguidance matches them by token id, so
a model cannot fake one with text); `name[max_tokens=N]` bounds a free-text rule.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from disagg_agents.decode.schemas import closed
from disagg_agents.wire.request import RequestError

# As in grammar.JSON_OPTIONS, carried inside each inline %json schema.
X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function-name rule
HARMONY_REASONING = """\
analysis: <|channel|> "analysis" <|message|> atext <|end|> <|start|> "assistant"
atext[max_tokens={budget}]: /(.|\\n)*/
"""


def inline(schema: Mapping[str, Any]) -> str:
    """A JSON schema as a lark `%json` nonterminal with our output options."""
    return "%json " + json.dumps({**schema, "x-guidance": X_GUIDANCE})  # keeps key order


def lark_str(text: str) -> str:
    return json.dumps(text)  # a lark string literal is JSON-quoted


def harmony_final_lark(schema: Mapping[str, Any], budget: int) -> str:
    """The whole harmony output: an optional analysis message of at most `budget`
    tokens, then the final message holding JSON, then <|return|> (so even random
    weights end with valid JSON in the final channel)."""
    return (
        'start: analysis? <|channel|> "final" <|message|> answer <|return|>\n'
        f"answer: {inline(schema)}\n" + HARMONY_REASONING.format(budget=max(1, budget))
    )


def lark_answer(lark: str, kind: str, budget: int) -> str:
    """llguidance's JSON for a caller's Lark grammar as the answer: as is, or for
    harmony inside the final message (the caller's grammar kept whole, as a
    sub-grammar, so its own `start` and rule names cannot clash with ours)."""
    if kind != "harmony":
        return json.dumps({"grammars": [{"lark_grammar": lark}]})
    main = (
        'start: analysis? <|channel|> "final" <|message|> answer <|return|>\n'
        "answer: @caller\n" + HARMONY_REASONING.format(budget=max(1, budget))
    )
    return json.dumps(
        {"grammars": [{"lark_grammar": main}, {"name": "caller", "lark_grammar": lark}]}
    )


def function_of(tool: Any) -> tuple[str, dict[str, Any]]:
    """(name, parameters schema) of an OpenAI tool ({"type": "function",
    "function": {...}}) or a bare function object."""
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise RequestError("tools", f"each tool needs a function name [A-Za-z0-9_.-], got {name!r}")
    params = fn.get("parameters") or {"type": "object"}  # type: ignore[union-attr]
    if not isinstance(params, Mapping):
        raise RequestError("tools", f"tool {name}: parameters must be a JSON Schema object")
    return name, dict(closed(params))


def forced_tools(tools: Sequence[Any] | None, tool_choice: Any) -> list[tuple[str, dict[str, Any]]]:
    """The functions one of which must be called: all for "required", the named
    one for {"type": "function", "function": {"name": N}}; [] when not forced."""
    if tool_choice in (None, "auto", "none"):
        return []
    funcs = [function_of(t) for t in tools or []]
    if tool_choice == "required":
        if not funcs:
            raise RequestError("tool_choice", 'tool_choice "required" needs at least one tool')
        return funcs
    name = None
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise RequestError(
            "tool_choice",
            'tool_choice must be "auto", "none", "required" or {"type": "function", '
            '"function": {"name": ...}}',
        )
    chosen = [f for f in funcs if f[0] == name]
    if not chosen:
        known = ", ".join(f[0] for f in funcs) or "none given"
        raise RequestError("tool_choice", f"tool_choice {name!r} is not among the tools ({known})")
    return chosen


def tool_call_lark(funcs: list[tuple[str, dict[str, Any]]], kind: str, budget: int) -> str:
    """One call of one of `funcs`, its arguments valid for its parameters, in the
    markup of `kind`."""
    rules = []
    for i, (name, params) in enumerate(funcs):
        if kind == "harmony":
            body = (
                f"<|channel|> {lark_str('commentary to=functions.' + name + ' ')} "
                f'<|constrain|> "json" <|message|> args{i} <|call|>'
            )
            rules.append(f"call{i}: {body}\nargs{i}: {inline(params)}")
        elif kind == "qwen_xml":
            rules.append(f"call{i}: {_qwen_xml_call(name, params)}")
        else:  # qwen_json, and plain: the call object alone
            call = {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            rules.append(f"call{i}: {inline(call)}")
    calls = " | ".join(f"call{i}" for i in range(len(funcs)))
    if kind == "harmony":
        head = f"start: analysis? ({calls})\n" + HARMONY_REASONING.format(budget=max(1, budget))
    elif kind in ("qwen_json", "qwen_xml"):
        head = f'start: "<tool_call>\\n" ({calls}) "\\n</tool_call>"\n'
    else:
        head = f"start: {calls}\n"
    return head + "\n".join(rules) + "\n"


def _raw_text(schema: Mapping[str, Any]) -> str:
    """A string parameter as Qwen3-Coder writes it: raw text (no '<', which would
    start the closing tag), within the schema's length bounds."""
    lo = int(schema.get("minLength") or 0)
    hi = schema.get("maxLength")
    return f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"


def _qwen_xml_call(name: str, params: dict[str, Any]) -> str:
    """Qwen3-Coder's <function=NAME><parameter=ARG>value</parameter></function>:
    strings as raw text, other values as JSON; required parameters always,
    optional ones may be left out (in the schema's order)."""
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    parts = [lark_str(f"<function={name}>\n")]
    for arg, sub in props.items():
        if not NAME_RE.match(str(arg)):
            raise RequestError("tools", f"tool {name}: parameter name {arg!r} cannot be written")
        sub = sub if isinstance(sub, Mapping) else {}
        words = sub.get("enum")
        if isinstance(words, list) and words and all(isinstance(w, str) for w in words):
            value = "(" + " | ".join(lark_str(w) for w in words) + ")"  # raw, as the parser reads
        elif sub.get("type") == "string":
            value = _raw_text(sub)
        else:
            value = inline(sub)
        opening = lark_str(f"<parameter={arg}>\n")
        part = f'{opening} {value} "\\n</parameter>\\n"'
        parts.append(part if arg in required else f"({part})?")
    parts.append(lark_str("</function>"))
    return " ".join(parts)


def generic_lark(tools: Sequence[Any]) -> str:
    """The generic tool format's answer (disagg_agents.chatformat.generic): one
    JSON object, a call of one of `tools` with arguments valid for its schema, or
    a response to the user."""
    calls = []
    for i, (name, params) in enumerate(function_of(t) for t in tools):
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        calls.append(f"call{i}: {inline(call)}")
    names = " | ".join(f"call{i}" for i in range(len(calls)))
    return (
        f'start: "{{\\"tool_call\\": " ({names}) "}}" | "{{\\"response\\": " answer "}}"\n'
        f"answer: {inline({'type': 'string'})}\n" + "\n".join(calls) + "\n"
    )

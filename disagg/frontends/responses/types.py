"""The Responses API's request body (pydantic) and its mapping straight onto the one
GenerateRequest, in the request's own terms (disagg.frontends.apirequest): input items as
chat messages, tools as functions, `text.format` as a response_format.

Stateless: every request carries its whole `input`; `previous_response_id` is
refused. Reasoning round-trips as plain text in `encrypted_content`. Hosted tools
(`web_search*`, `mcp`, `namespace`) are ignored: clients send them by default and
nothing here can run them."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from disagg.frontends.apirequest import Message, build
from disagg.frontends.refusal import ApiError
from disagg_agents.runtime.grammarcheck import CompileCheck, TooSlow
from disagg_agents.wire.request import GRAMMAR_MAX_CHARS, GenerateRequest
from disagg_agents.wire.schemasize import TOOLS_MAX_CHARS, SchemaTooBig, check_lark

IGNORED_TOOLS = ("web_search", "web_search_preview", "mcp", "namespace")
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}
EFFORTS |= {"xhigh": "high"}
GRAMMARS_MAX_CHARS = TOOLS_MAX_CHARS  # all custom tools' grammars together
# The gateway's own grammar-checking children (a crash there is one request's 400).
GRAMMAR_CHECK = CompileCheck()
# A custom (freeform) tool, shown to the model as a function of one string.
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


class Reasoning(BaseModel):
    effort: str | None = None
    summary: str | None = None  # accepted: the reasoning comes whole, never summarized


class ResponsesRequest(BaseModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted: calls come as the model makes them
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    stream: bool = False
    store: bool | None = None  # accepted: nothing is stored either way
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # accepted: the prefix cache needs no key
    user: str | None = None
    truncation: str | None = None
    service_tier: str | None = None
    seed: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def wants_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])


def tools_of(body: ResponsesRequest) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The function tools (custom ones as functions of one string) and the custom
    tools by name. Every custom tool's grammar is measured here, forced or not:
    three unforced 1.2 MB grammars once held the gateway's event loop 24 s."""
    functions, custom = [], {}
    grammar_chars = 0
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        name = tool.get("name")
        if kind in IGNORED_TOOLS:
            continue
        if kind not in ("function", "custom") or not isinstance(name, str):
            raise bad(f"tools[{i}]: type {kind!r} is not served (function and custom are)", "tools")
        fn: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"tools[{i}].description must be text", "tools")
        if description:
            fn["description"] = description
        if kind == "custom":
            custom[name] = tool
            fn["parameters"] = CUSTOM_PARAMETERS
            grammar = grammar_of(tool)
            grammar_chars += len(grammar["grammar"]) if grammar else 0
            if grammar_chars > GRAMMARS_MAX_CHARS:
                raise bad(
                    f"the custom tools' grammars are over {GRAMMARS_MAX_CHARS} characters in all",
                    "tools",
                )
        else:
            params = tool.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise bad(f"tools[{i}].parameters must be a JSON Schema object", "tools")
            fn["parameters"] = params or {"type": "object", "properties": {}}
        functions.append({"type": "function", "function": fn})
    return functions, custom


def grammar_of(tool: dict[str, Any]) -> dict[str, Any] | None:
    """A custom tool's `format` as a response_format: its Lark grammar, or None (free
    text). Its size and shape are checked here, without compiling it (a compile
    is `compile_error`'s, in a child process)."""
    name = tool.get("name")
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad(f"tool {name}: format must be an object ({{type: text | grammar}})", "tools")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") != "grammar" or fmt.get("syntax", "lark") != "lark":
        raise bad(f"tool {name}: format must be text or a Lark grammar", "tools")
    definition = fmt.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise bad(f"tool {name}: a grammar format needs its definition", "tools")
    if len(definition) > GRAMMAR_MAX_CHARS:
        raise bad(
            f"tool {name}: its grammar is {len(definition)} characters; at most "
            f"{GRAMMAR_MAX_CHARS}",
            "tools",
        )
    try:
        check_lark(definition, "tools", f"tool {name}'s grammar")
    except SchemaTooBig as e:
        raise bad(str(e), "tools") from None
    return {"type": "lark", "grammar": definition}  # the request's response_format


def compile_error(custom: dict[str, dict[str, Any]]) -> ApiError | None:
    """The 400 for the first custom tool whose grammar does not compile, or None.
    Blocking (a child process compiles each): call it off the event loop."""
    for name, tool in custom.items():
        grammar = grammar_of(tool)
        if grammar is None:
            continue
        try:
            error = GRAMMAR_CHECK.check(
                json.dumps({"grammars": [{"lark_grammar": grammar["grammar"]}]})
            )
        except TooSlow as e:
            error = f"{e}; make it smaller"
        if error:
            return bad(f"tool {name}: its Lark grammar does not compile: {error.strip()}", "tools")
    return None


def text_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as the request's response_format (OpenAI's chat shape, which
    GenerateRequest.normalize_format reads)."""
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad("text.format must be an object: {type: text | json_object | json_schema}", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {"name": fmt.get("name", "output"), "schema": fmt["schema"]}
        return {"type": "json_schema", "json_schema": {**spec, "strict": bool(fmt.get("strict"))}}
    raise bad("text.format: text, json_object or json_schema with a schema", "text.format")


def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise bad(f"{where}: content must be text or a list of content parts", "input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal", "summary_text"):
            raise bad(f"{where}: content part of type {kind!r}: disagg's models take text", "input")
        out.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(out)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: ours comes back in encrypted_content, as plain text."""
    if isinstance(item.get("encrypted_content"), str):
        return item["encrypted_content"]
    for key in ("content", "summary"):
        if item.get(key):
            return _parts_text(item[key], "reasoning")
    return ""


class _History:
    """Chat messages built item by item: calls join the assistant turn before them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning = ""  # a reasoning item's text, for the assistant turn that follows

    def assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning:
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        if self.reasoning:
            last["reasoning"], self.reasoning = self.reasoning, ""
        return last

    def call(self, item: dict[str, Any], arguments: str) -> None:
        turn = self.assistant()
        call = {"name": str(item.get("name", "")), "arguments": arguments}
        turn.setdefault("tool_calls", []).append(
            {"id": item.get("call_id"), "type": "function", "function": call}
        )

    def add(self, i: int, item: dict[str, Any]) -> None:
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}: role {role!r}", "input")
            text = _parts_text(item.get("content"), where)
            if role == "assistant":
                turn = self.assistant()
                if turn.get("tool_calls"):  # text after calls: a turn of its own
                    turn = {"role": "assistant", "content": None}
                    self.messages.append(turn)
                turn["content"] = (turn["content"] or "") + text
            else:
                self.messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            self.reasoning += _reasoning_text(item)
        elif kind == "function_call":
            self.call(item, str(item.get("arguments") or "{}"))
        elif kind == "custom_tool_call":
            self.call(item, json.dumps({"input": str(item.get("input", ""))}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = item.get("output")
            text = out if isinstance(out, str) else _parts_text(out, where)
            self.messages.append(
                {"role": "tool", "content": text, "tool_call_id": item.get("call_id")}
            )
        else:
            raise bad(f"{where}: item type {kind!r} is not served here", "input")


def messages_of(body: ResponsesRequest) -> list[Message]:
    history = _History()
    if body.instructions:
        history.messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        history.messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            if not isinstance(item, dict):
                raise bad(f"input[{i}] must be an object", "input")
            history.add(i, item)
    for m in history.messages:
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""
    if not history.messages:
        raise bad("input: nothing to answer", "input")
    return [Message.model_validate(m) for m in history.messages]


def request_fields(body: ResponsesRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The body as the one request's fields (`build`'s arguments), and the custom
    tools by name: every check but the request's own limits, which `build` makes."""
    if body.previous_response_id is not None:
        raise bad(
            "previous_response_id: this server keeps no responses (stateless); "
            "send the whole conversation in input",
            "previous_response_id",
        )
    tools, custom = tools_of(body)  # every grammar's size and shape: a 400 now
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None and effort not in EFFORTS:
        raise bad(f"reasoning.effort {effort!r}: low, medium or high", "reasoning.effort")
    fields: dict[str, Any] = {
        "max_tokens": body.max_output_tokens,
        "messages": [m.as_request() for m in messages_of(body)],
    }
    if tools:
        fields.update(tools=tools, tool_choice=_tool_choice(body.tool_choice))
    fields.update(
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        response_format=text_format(body),
        think=EFFORTS.get(effort or ""),
    )
    return fields, custom


def generate_request(
    body: ResponsesRequest,
) -> tuple[GenerateRequest, dict[str, dict[str, Any]]]:
    """The body as the one request (its cache salt is the route's to add), and the
    custom tools by name. Raises ApiError 400 for a bad field."""
    fields, custom = request_fields(body)
    return build(**fields), custom


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools":
        return str(choice.get("mode", "auto"))
    raise bad(f"tool_choice of type {kind!r}", "tool_choice")


def forced_custom(body: ResponsesRequest, custom: dict[str, dict[str, Any]]) -> str | None:
    """The custom tool the request forces, if one: its input follows its grammar."""
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "custom" and choice.get("name") in custom:
        return str(choice["name"])
    functions = [t for t in body.tools or [] if t.get("type") == "function"]
    if choice == "required" and len(custom) == 1 and not functions:
        return next(iter(custom))
    return None

"""gpt-oss prompts as openai-harmony renders them (the model's reference
renderer, which vLLM uses; the checkpoint's jinja template differs from it).

A conversation becomes harmony messages: a system message (identity, knowledge
cutoff, date, reasoning effort, channels), a developer message (instructions
and the tools as a TypeScript namespace), then the turns. An earlier call keeps
its arguments exactly as the model wrote them; a tool's result is its text;
reasoning is dropped from every turn before the last final answer and kept
inside the tool loop that is still going on. Each piece of text is encoded
alone and as plain text: only the renderer's markup is special tokens.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .literal import text_encoder
from .tstypes import tools_section

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
CHANNELS = (
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
FUNCTIONS_NOTE = "Calls to these tools must go to the commentary channel: 'functions'."
CONSTRAIN = "<|constrain|>"


class HarmonyError(ValueError):
    """The conversation cannot be written in harmony."""


@dataclass(frozen=True)
class Message:
    """One harmony message: `<|start|>{author}[ to={recipient}][<|channel|>{channel}]
    [ {content_type}]<|message|>{text}<|end|>` (`<|call|>` for an assistant's call)."""

    author: str  # a role, or a tool's name ("functions.get_weather")
    text: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None


def effort_of(think: bool | str | None) -> str:
    """Harmony always reasons: "no thinking" is its least effort."""
    if think is None or think is True:
        return "medium"
    if think is False:
        return "low"
    if think not in EFFORTS:
        raise HarmonyError(f"think: reasoning effort must be one of {', '.join(EFFORTS)}")
    return think


def system_message(effort: str, has_tools: bool, today: str | None = None) -> Message:
    # DISAGG_TODAY pins the stated date: the same prompt renders the same tokens on
    # every day (reproducible runs; the tests' random models answer by the date).
    date = today or os.environ.get("DISAGG_TODAY") or datetime.date.today().isoformat()
    top = f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}"
    channels = CHANNELS + (f"\n{FUNCTIONS_NOTE}" if has_tools else "")
    return Message("system", f"{top}\n\nReasoning: {effort}\n\n{channels}")


def developer_message(instructions: str | None, tools: list[Any] | None) -> Message | None:
    sections = []
    if instructions is not None:
        sections += ["# Instructions", instructions]
    if tools:
        sections.append(tools_section([_function(t) for t in tools]))
    return Message("developer", "\n\n".join(sections)) if sections else None


def _function(tool: Any) -> tuple[str, str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
    return str(fn.get("name", "")), str(fn.get("description") or ""), fn.get("parameters")


def text_of(content: Any) -> str:
    """A message's content as text: a string as it is, OpenAI's parts joined,
    anything else (a tool's structured result) as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return json.dumps(content, ensure_ascii=False)


def arguments_text(args: Any) -> str:
    """An earlier call's arguments as the model wrote them: a string (OpenAI's
    clients send back what we returned) unchanged, an object (Ollama's) as
    compact JSON, as gpt-oss writes it."""
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False, separators=(",", ":"))


def conversation(
    messages: list[dict[str, Any]],
    *,
    system: str | None = None,
    tools: list[Any] | None = None,
    think: bool | str | None = None,
    today: str | None = None,
) -> list[Message]:
    """The harmony messages of a chat request, ready for `<|start|>assistant`."""
    msgs = list(messages)
    lead = [system] if system else []
    while msgs and msgs[0].get("role") in ("system", "developer"):
        lead.append(text_of(msgs.pop(0).get("content")))
    out = [system_message(effort_of(think), bool(tools), today)]
    dev = developer_message("\n\n".join(lead) if lead else None, tools)
    out += [dev] if dev is not None else []
    names: dict[str, str] = {}  # tool_call_id -> function name
    last_call = ""
    for m in one_call_per_turn(msgs):
        role = m.get("role")
        if role == "assistant":
            turn = _assistant(m)
            out += turn
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                last_call = str(fn.get("name", ""))
                if call.get("id"):
                    names[str(call["id"])] = last_call
        elif role == "tool":
            name = names.get(str(m.get("tool_call_id") or "")) or m.get("name") or last_call
            if not name:
                raise HarmonyError("messages: a tool result must follow the call it answers")
            text = text_of(m.get("content"))
            out.append(Message(f"functions.{name}", text, "commentary", "assistant"))
        elif role in ("system", "developer"):
            out.append(Message("developer", "# Instructions\n\n" + text_of(m.get("content"))))
        elif role == "user":
            out.append(Message("user", text_of(m.get("content"))))
        else:
            raise HarmonyError(f"messages: unknown role {role!r}")
    return _drop_old_reasoning(out)


def one_call_per_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt-oss makes one call and reads its result before the next: parallel
    calls (another model's, in the history) become call, result, call, result
    (results matched by tool_call_id, else taken in order)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        i += 1
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        by_id = {r["tool_call_id"]: r for r in results if r.get("tool_call_id")}
        rest = [r for r in results if not r.get("tool_call_id")]
        for n, call in enumerate(calls):
            out.append({**m, "tool_calls": [call]} if n == 0 else _only(call))
            result = by_id.pop(call.get("id"), None) or (rest.pop(0) if rest else None)
            out += [result] if result is not None else []
        out += [*by_id.values(), *rest]
    return out


def _only(call: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _assistant(m: dict[str, Any]) -> list[Message]:
    """An assistant turn: its reasoning, then a preamble and its calls, or its answer."""
    out = []
    reasoning = m.get("thinking") or m.get("reasoning_content") or m.get("reasoning")
    if reasoning:
        out.append(Message("assistant", text_of(reasoning), "analysis"))
    content = text_of(m.get("content"))
    calls = m.get("tool_calls") or []
    if not calls:
        return out + ([Message("assistant", content, "final")] if content else [])
    if content:
        out.append(Message("assistant", content, "commentary"))
    for call in calls:
        fn = call.get("function", call)
        args = arguments_text(fn.get("arguments"))
        to = f"functions.{fn.get('name', '')}"
        out.append(Message("assistant", args, "commentary", to, f"{CONSTRAIN}json"))
    return out


def _drop_old_reasoning(msgs: list[Message]) -> list[Message]:
    """Reasoning before the last final answer led to an answer already given:
    the model never sees it again (the harmony guide; vLLM does the same)."""
    last = max((i for i, m in enumerate(msgs) if m.channel == "final"), default=-1)
    return [m for i, m in enumerate(msgs) if not (i < last and m.channel == "analysis")]


Segment = tuple[bool, str]  # (special?, text): a markup token by name, or plain text


def segments(msgs: list[Message]) -> list[Segment]:
    """The messages as openai-harmony writes them, then `<|start|>assistant`;
    each text segment is encoded on its own."""
    out: list[Segment] = []
    for m in msgs:
        out += [(True, "<|start|>"), (False, m.author)]
        if m.recipient is not None and m.recipient != "all":
            out.append((False, f" to={m.recipient}"))
        if m.channel is not None:
            out += [(True, "<|channel|>"), (False, m.channel)]
        if m.content_type is not None:
            if m.content_type.startswith(CONSTRAIN):
                rest = m.content_type.removeprefix(CONSTRAIN)
                out += [(False, " "), (True, CONSTRAIN)] + ([(False, rest)] if rest else [])
            else:
                out.append((False, f" {m.content_type}"))
        out += [(True, "<|message|>"), (False, m.text)]
        call = m.author == "assistant" and m.recipient is not None
        out.append((True, "<|call|>" if call else "<|end|>"))
    return out + [(True, "<|start|>"), (False, "assistant")]


def encode(tokenizer: Any, special_ids: Mapping[str, int], segs: list[Segment]) -> list[int]:
    """Segments as token ids: markup by its id, text as plain text."""
    enc = text_encoder(tokenizer)
    ids: list[int] = []
    for special, text in segs:
        if not special:
            ids += enc.encode(text)
        elif text in special_ids:
            ids.append(special_ids[text])
        elif text != CONSTRAIN:  # without <|constrain|>: " json", the older spelling
            raise HarmonyError(f"the tokenizer has no {text} token")
    return ids

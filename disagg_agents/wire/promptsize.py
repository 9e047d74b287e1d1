"""Size bounds a request passes before anyone spends anything on it (the gateway,
the decode agent, the prefill agent's embeddings): a prompt that cannot fit the
context is refused before tokenizing (a 3.9 MB one took 5.8 CPU-s and 330 MB to
tokenize)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg_agents.wire.request import GenerateRequest


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token spells: the longest vocab
    entry's UTF-8 (byte-level BPE writes a byte as one char of at most 2 bytes,
    SentencePiece's "▁" and "<0x41>" are longer than what they stand for), added
    and special tokens included."""
    vocab = tokenizer.get_vocab()
    longest = max((len(str(t).encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    return max(1, longest)


# A message's fields a chat template writes out (ids and roles' names aside).
RENDERED = ("content", "reasoning", "reasoning_content", "thinking")


def prompt_bytes(req: GenerateRequest) -> int:
    """UTF-8 bytes of all the request's text: prompt, system, suffix, and every
    string in its messages (content, reasoning and thinking, tool calls' arguments,
    tool results) and tools (names, descriptions, schemas). A 3.5 MB tool
    description or thinking block was tokenized whole (4.8 s) before this counted it."""
    texts: list[Any] = [req.prompt, req.system, req.suffix]
    for m in req.messages or []:
        texts += [m.get(key) for key in RENDERED]
        for call in m.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, Mapping) else None
            texts.append(fn.get("arguments") if isinstance(fn, Mapping) else None)
    total = sum(strings_bytes(t) for t in texts)
    return total + strings_bytes(req.tools, keys=True)  # rendered as JSON: keys too


def strings_bytes(node: Any, keys: bool = False) -> int:
    """UTF-8 bytes of every string inside `node` (with `keys`, objects' keys too),
    without recursion (arguments may nest deep)."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        if isinstance(n, str):
            total += _utf8(n)
        elif isinstance(n, Mapping):
            if keys:
                stack.extend(n.keys())
            stack.extend(n.values())
        elif isinstance(n, list | tuple):
            stack.extend(n)
    return total


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def too_long(req: GenerateRequest, context: int, token_bytes: int) -> str | None:
    """Why the prompt surely cannot fit `context` tokens, or None: no token spells
    more than `token_bytes` bytes, so bytes // token_bytes is a sure lower bound
    on its tokens (a chat template only adds some)."""
    size = prompt_bytes(req)
    at_least = size // max(1, token_bytes)
    if at_least < context:
        return None
    return (
        f"the prompt (messages, reasoning, tool calls and tools) is {size} bytes, at "
        f"least {at_least} tokens; the model's context is {context}: shorten the prompt"
    )

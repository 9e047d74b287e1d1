"""Checks a request passes before the decode agent spends anything on it: a
prompt that cannot fit the context is refused before tokenizing (a 3.9 MB one
took 5.8 CPU-s and 330 MB to tokenize), and a client that left is noticed
while its grammar compiles."""

from __future__ import annotations

import select
import socket
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


def prompt_bytes(req: GenerateRequest) -> int:
    """UTF-8 bytes of the request's text (prompt, system, suffix, messages)."""
    texts: list[Any] = [req.prompt, req.system, req.suffix]
    texts += [m.get("content") for m in req.messages or []]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))


def too_long(req: GenerateRequest, context: int, token_bytes: int) -> str | None:
    """Why the prompt surely cannot fit `context` tokens, or None: no token spells
    more than `token_bytes` bytes, so bytes // token_bytes is a sure lower bound
    on its tokens (a chat template only adds some)."""
    size = prompt_bytes(req)
    at_least = size // max(1, token_bytes)
    if at_least < context:
        return None
    return (
        f"the prompt is {size} bytes, at least {at_least} tokens; the model's context is "
        f"{context}: shorten the prompt"
    )


def client_gone(sock: socket.socket) -> bool:
    """The client closed its end (or the connection broke), without blocking.
    A pipelined next request is data, not a hang-up."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True

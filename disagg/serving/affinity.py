"""Prefix affinity: which decode agent most likely holds a request's prefix.

A decode agent keeps the K/V of the prompts it served (disagg_agents.prefix), so a chat's
next turn is cheapest where its last turn ran. The router cannot tokenize (agents
do), so a request's prefixes are keyed on its content instead: a chat by a hash
chain over its messages (key i covers messages[:i+1]), a prompt by a chain over
fixed CHUNK_CHARS-character chunks of its text. Every chain starts from a root
of what the chat template puts before the messages (system, tools, think, raw)
and of the pipeline and the cache_salt: different salts never share a key, as
the agents' caches never share their K/V. Each served request remembers its keys
-> the agent that served it (a bounded LRU); the next request goes to the agent
holding its longest remembered prefix, unless that agent is too busy (`choose`).

The rule: stay on the affine agent while busy[affine] - busy[least] <= slack,
slack = min(MAX_SLACK, 1 + expected hit tokens // TOKENS_PER_SLOT). A decode
agent batches continuously, so one more stream costs its other streams a
fraction of a decode step each, while a miss costs the whole prefix again: its
prefill (which pauses the other agent's batch) and, disaggregated, its K/V on
the wire. So any hit is worth one stream of imbalance, and every further
TOKENS_PER_SLOT tokens of expected hit one more, up to MAX_SLACK (a quarter of
the decode agent's default max_batch of 32). Past it the request spills to the
least busy agent, whose keys then take over the chat.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from disagg_agents.wire.request import GenerateRequest

CHUNK_CHARS = 256  # a raw prompt's prefixes: whole chunks of this many characters
CHARS_PER_TOKEN = 4  # a rough guess of English text; only used to weigh a hit
TOKENS_PER_SLOT = 512  # expected hit tokens that buy one more stream of imbalance
MAX_SLACK = 8  # a quarter of the decode agent's default max_batch (disagg_agents.decode.loop)
MAX_KEYS = 1 << 16  # remembered prefixes (~100 bytes each): the LRU's bound


class PrefixKey(NamedTuple):
    key: bytes
    chars: int  # characters of content the prefix covers (weighs the hit)


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"\0".join(parts), digest_size=16).digest()


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()


def prefix_keys(pipeline: str, req: GenerateRequest) -> list[PrefixKey]:
    """The request's prefix keys, shortest first: none for a short raw prompt, or
    when the agents would not reuse its K/V (cache off, lossy int8 K/V)."""
    if not req.prefix_cache or req.kv_quant:
        return []
    root = _h(
        _canon(
            {
                "pipeline": pipeline,
                "salt": req.cache_salt,
                "raw": req.raw,
                "system": req.system,
                "tools": req.tools,
                "think": req.think,
                "fim": req.suffix is not None,
            }
        )
    )
    out: list[PrefixKey] = []
    h, chars = root, 0
    if req.messages is not None:
        for msg in req.messages:
            body = _canon(msg)
            h, chars = _h(h, body), chars + len(body)
            out.append(PrefixKey(h, chars))
    elif req.prompt is not None:
        text = req.prompt
        for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
            h = _h(h, text[start : start + CHUNK_CHARS].encode())
            out.append(PrefixKey(h, start + CHUNK_CHARS))
    return out


def slack(hit_chars: int) -> int:
    """How many more streams than the least busy agent the affine one may serve."""
    return min(MAX_SLACK, 1 + hit_chars // CHARS_PER_TOKEN // TOKENS_PER_SLOT)


@dataclass(frozen=True)
class Choice:
    """The router's pick for one request, and why (a result's `route` metric)."""

    agent: str | None  # None: no affinity applies, take the least busy
    affine: str | None  # the agent holding the longest remembered prefix
    hit_chars: int  # the characters that prefix covers
    busy: dict[str, int]  # requests in flight per candidate at the moment of choice
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "affine": self.affine,
            "hit_chars": self.hit_chars,
            "busy": self.busy,
            "reason": self.reason,
        }


def choose(affine: str | None, hit_chars: int, busy: Mapping[str, int]) -> Choice:
    """Apply the module's rule. `busy`: the healthy candidates' in-flight counts."""
    snap = dict(busy)
    if affine is None or affine not in snap:
        why = "no remembered prefix" if affine is None else f"affine agent {affine} is down"
        return Choice(None, affine, hit_chars, snap, why + ": least busy")
    least = min(snap.values())
    allowed = slack(hit_chars)
    over = snap[affine] - least
    if over > allowed:
        why = f"affine agent {affine} serves {over} more than the least busy (slack {allowed})"
        return Choice(None, affine, hit_chars, snap, why + ": least busy")
    why = f"prefix of {hit_chars} chars on {affine} (busy {snap[affine]}, least {least})"
    return Choice(affine, affine, hit_chars, snap, why)


class AffinityTable:
    """Prefix key -> the decode agent that last served it; LRU, thread-safe."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max(1, max_keys)
        self.lock = threading.Lock()
        self.owner: OrderedDict[bytes, str] = OrderedDict()

    def match(self, keys: list[PrefixKey]) -> tuple[str | None, int]:
        """(agent, chars) of the longest remembered prefix; (None, 0) if none."""
        with self.lock:
            for k in reversed(keys):
                agent = self.owner.get(k.key)
                if agent is not None:
                    self.owner.move_to_end(k.key)
                    return agent, k.chars
        return None, 0

    def remember(self, keys: list[PrefixKey], agent: str) -> None:
        """`agent` served a request with these prefixes: it now holds them all."""
        with self.lock:
            for k in keys:  # shortest first: the longest ends most recently used
                self.owner[k.key] = agent
                self.owner.move_to_end(k.key)
            while len(self.owner) > self.max_keys:
                self.owner.popitem(last=False)

    def __len__(self) -> int:
        with self.lock:
            return len(self.owner)

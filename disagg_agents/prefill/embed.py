"""Embeddings on the prefill agent: the prompt's forward pass without any K/V
transfer, its last hidden states pooled into one L2-normalized vector per text.

Pooling comes from the checkpoint (disagg_agents/models/pooling.py): sentence-transformers'
pooling config where it has one, mean over the tokens otherwise. A client asks with
a HELLO of role "embed" (no fingerprint: nothing it receives depends on another
agent's cache layout), then EMBED frames.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch

from disagg_agents.models.pooling import pooling_of
from disagg_agents.runtime.hangup import client_gone
from disagg_agents.wire.channel import recv_json, send_error, send_json
from disagg_agents.wire.embedreply import EmbedReply
from disagg_agents.wire.frames import Frame, ProtocolError, RemoteError
from disagg_agents.wire.promptsize import max_token_bytes

INPUTS_MAX = 512  # texts per EMBED
TEXT_MAX_CHARS = 1 << 20
# Tokens per EMBED, all inputs together: 512 inputs at a full context were ~35
# minutes of one CPU's prefill for one ~3 MB request.
TOKENS_MAX = 65536


class Gone(Exception):
    """The client hung up: the rest of the forward pass, and the inputs left, are
    not computed."""


def _stop_if(gone: Callable[[], bool]) -> Callable[..., None]:
    """A forward pre-hook for each decoder layer: Gone before the layer runs once
    the client left (a long input's forward is many seconds; a layer, a fraction)."""

    def check(module: Any, args: Any) -> None:
        if gone():
            raise Gone

    return check


def pool(hidden: torch.Tensor, how: str) -> torch.Tensor:
    """[S, H] hidden states -> [H] float32, L2-normalized."""
    h = hidden.float()
    if how == "last":
        v = h[-1]
    elif how == "cls":
        v = h[0]
    elif how == "max":
        v = h.max(dim=0).values
    else:
        v = h.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0)


def too_long(tokens: str, limit: int) -> str:
    return (
        f"an input has {tokens} tokens, over the limit of {limit} per input: shorten it "
        "(Ollama's /api/embed cuts it unless it sends truncate: false)"
    )


class Embedder:
    """One engine's embeddings: its tokenizer (loaded on first use) and pooling."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pooling = pooling_of(engine.model_dir)
        self._tok: Any = None
        self._token_bytes: int | None = None
        cfg = engine.cfg
        self.context = int(cfg.get("max_position_embeddings") or 4096)

    def tokenizer(self) -> Any:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.engine.model_dir)
        return self._tok

    def token_bytes(self) -> int:
        """The most bytes of text one token spells (upfront.max_token_bytes), once."""
        if self._token_bytes is None:
            self._token_bytes = max_token_bytes(self.tokenizer())
        return self._token_bytes

    def ids(self, text: str, truncate: bool, limit: int) -> list[int]:
        """The text's token ids, cut to `limit` when `truncate`, else a ValueError
        past it. Refused untokenized when its bytes alone prove it too long (a
        ~147k-token text took seconds to tokenize only to be refused)."""
        if not truncate:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size // self.token_bytes() > limit:
                raise ValueError(too_long(f"at least {size // self.token_bytes()}", limit))
        ids = list(self.tokenizer()(text, add_special_tokens=True)["input_ids"]) or [0]
        if len(ids) > limit:
            if not truncate:
                raise ValueError(too_long(str(len(ids)), limit))
            ids = ids[:limit]
        return ids

    @torch.inference_mode()
    def vector(self, ids: list[int], gone: Callable[[], bool] = lambda: False) -> list[float]:
        """One input's vector; `gone()` is asked before each decoder layer (Gone)."""
        x = torch.tensor([ids], device=self.engine.device)
        with self.engine.slots.slot(len(ids)):  # behind other prompts' forward passes
            # Hooks are per module, shared by all requests: added only in the slot.
            stop = _stop_if(gone)
            handles = [layer.register_forward_pre_hook(stop) for layer in self.engine.layers]
            try:
                out = self.engine.body(input_ids=x, use_cache=False)
            finally:
                for h in handles:
                    h.remove()
        return [float(f) for f in pool(out.last_hidden_state[0], self.pooling).cpu()]

    def answer(
        self, req: dict[str, Any], gone: Callable[[], bool] = lambda: False
    ) -> dict[str, Any]:
        """The vectors of req's inputs, within TOKENS_MAX in all; `gone()` is asked
        before each input and each decoder layer (Gone: the client left, stop there)."""
        texts = req.get("input")
        if not isinstance(texts, list) or not 0 < len(texts) <= INPUTS_MAX:
            raise ValueError(f"input must be a list of 1 to {INPUTS_MAX} texts")
        if not all(isinstance(t, str) and len(t) <= TEXT_MAX_CHARS for t in texts):
            raise ValueError(f"each input must be text of at most {TEXT_MAX_CHARS} characters")
        asked = req.get("max_tokens")
        limit = min(asked, self.context) if isinstance(asked, int) and asked > 0 else self.context
        ids, total = [], 0
        for text in texts:  # stops tokenizing once over: the work is bounded too
            ids.append(self.ids(text, req.get("truncate") is not False, limit))
            total += len(ids[-1])
            if total > TOKENS_MAX:
                raise ValueError(
                    f"the inputs are over {TOKENS_MAX} tokens in all; send fewer or shorter ones"
                )
        vectors = []
        for one in ids:
            if gone():
                raise Gone
            vectors.append(self.vector(one, gone))
        return EmbedReply(vectors, total, self.pooling).to_json()

    def serve(self, sock: socket.socket, max_bytes: int) -> None:
        """EMBED frames until the client hangs up; a bad one gets an ERROR and the
        connection stays usable."""
        while True:
            try:
                _, req = recv_json(sock, Frame.EMBED, max_bytes)
            except (ProtocolError, RemoteError, OSError):
                return
            try:
                reply = self.answer(req, lambda: client_gone(sock))
            except Gone:
                return
            except ValueError as e:
                send_error(sock, "bad_request", str(e))
                continue
            send_json(sock, Frame.EMBEDDING, reply)

"""The prefill agent's EMBEDDING frame as the control plane reads it. Stdlib only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EmbedReply:
    """One vector per input, the prompt tokens they took, and the pooling used."""

    embeddings: list[list[float]]
    prompt_tokens: int = 0
    pooling: str = ""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EmbedReply:
        """The frame's JSON; a missing count reads as 0, a missing pooling as ""."""
        vectors = d.get("embeddings")
        if not isinstance(vectors, list):
            raise ValueError("the EMBEDDING reply has no list of embeddings")
        tokens = d.get("prompt_tokens")
        return cls(
            vectors,
            tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0,
            str(d.get("pooling") or ""),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "embeddings": self.embeddings,
            "prompt_tokens": self.prompt_tokens,
            "pooling": self.pooling,
        }

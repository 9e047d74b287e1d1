"""The embedding request bodies of Ollama's and OpenAI's APIs (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class OllamaEmbed(BaseModel):
    model: str
    input: str | list[str] = Field(min_length=1)
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: str | int | float | None = None  # accepted: agents stay loaded
    options: dict[str, Any] | None = None  # num_ctx caps the tokens per input

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input

    def max_tokens(self) -> int | None:
        n = (self.options or {}).get("num_ctx")
        return n if isinstance(n, int) and n > 0 else None


class OllamaEmbeddings(BaseModel):
    """The older /api/embeddings: one prompt, one vector."""

    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OpenAIEmbeddings(BaseModel):
    model: str
    # Text only: token-id arrays (also allowed by OpenAI) are refused with a 400.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

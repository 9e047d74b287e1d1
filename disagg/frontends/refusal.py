"""The refusals every front door answers with, as data: `ApiError` carries what an
OpenAI-family body names (chat, Responses and embeddings share that shape) and
the status and message every other API builds its own body from; `PlainError`
is answered as `{"error": message}` (Ollama's shape)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A refusal: HTTP `status` and `message`, with the kind (`type_`), the field
    (`param`) and `code` an OpenAI-family body names; `headers` (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class PlainError(Exception):
    """A refusal answered as `{"error": message}` with this status (Ollama's shape)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

"""The web view's request list: a refused request shows the reason its client got,
and a prompt's preview is the user's words, not what an agent CLI wraps around them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from disagg.frontends.app import ListRefusals, error_message
from disagg.frontends.webview.tracker import RequestLog, prompt_of

CLAUDE_TURN = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following "
    "context:\n# claudeMd\n...\n</system-reminder>\nSay hi."
)


def test_the_preview_is_the_users_words() -> None:
    assert prompt_of({"messages": [{"role": "user", "content": CLAUDE_TURN}]}) == "Say hi."
    parts: Any = [{"type": "text", "text": "<system-reminder>x</system-reminder>"}, {"text": "Hi"}]
    assert prompt_of({"messages": [{"role": "user", "content": parts}]}) == "Hi"
    assert prompt_of({"prompt": "plain  words\n"}) == "plain words"


def test_error_message_reads_each_apis_shape() -> None:
    assert error_message(b'{"error": {"message": "too long", "type": "x"}}') == "too long"
    assert error_message(b'{"type": "error", "error": {"message": "no"}}') == "no"
    assert error_message(b'{"error": "model not found"}') == "model not found"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"<html>") is None


def test_a_refused_row_carries_its_reason() -> None:
    log = RequestLog([])
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def refuse() -> JSONResponse:
        msg = "the prompt is 20005 tokens; the model's context is 8192: shorten the prompt"
        return JSONResponse({"error": {"message": msg}}, status_code=400)

    app.add_middleware(ListRefusals, log=log)
    assert TestClient(app).post("/v1/chat/completions", json={}).status_code == 400
    (row,) = log.snapshot(None, everyone=True)
    assert row["state"] == "refused" and row["error"] == "HTTP 400", row
    assert "context is 8192" in row["why"], row


def test_a_request_that_ran_and_failed_is_one_row() -> None:
    """Claude Code's prompt past the context: the request ran (one row, its error)
    and answered 400; the refusal list does not show it again."""
    log = RequestLog([])
    app = FastAPI()
    msg = "the prompt is 20005 tokens; the model's context is 8192: shorten the prompt"

    @app.post("/v1/messages")
    def ran() -> JSONResponse:  # a worker thread, as the doors' requests run
        t = log.begin("SmolLM2-135M-Instruct", {"prompt": "Say hi."})
        log.end(t, None, msg, "error")
        return JSONResponse({"type": "error", "error": {"message": msg}}, status_code=400)

    @app.post("/v1/chat/completions")
    async def refuse() -> JSONResponse:
        return JSONResponse({"error": {"message": "no such model"}}, status_code=400)

    app.add_middleware(ListRefusals, log=log)
    client = TestClient(app)
    assert client.post("/v1/messages", json={}).status_code == 400
    (row,) = log.snapshot(None, everyone=True)
    assert row["state"] != "refused" and msg in (row["error"] or ""), row
    # A request refused before it ran is still listed, once.
    assert client.post("/v1/chat/completions", json={}).status_code == 400
    rows = log.snapshot(None, everyone=True)
    assert [r["state"] for r in rows].count("refused") == 1 and len(rows) == 2, rows

"""The verdict header (disagg.serving.verdict): on every API's answer, whole and
streamed, and true for remote, local and fallback runs of real agents."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from disagg.serving.completion import Chunk
from disagg.serving.localagents import free_port
from disagg.serving.router import Endpoint, Route, Router
from disagg.serving.verdict import HEADER, PATHS, header_value, parse, streamed, verdict
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.request import GenerateRequest
from tests.agentpool import AgentSet
from tests.gateways import Gateway, PooledClient, start_gateway

# The served name -> the placement its requests are forced to, and the path that runs.
RUNS = {"remote": "remote", "local": "local", "fallback": "local-after-failure"}
PLACE = {"remote": "remote", "local": "local", "fallback": "remote"}


def test_verdict_fields_from_metrics() -> None:
    m = Metrics(method="disaggregated", cached_tokens=48, prefill_cached_tokens=64)
    m.disk_cached_tokens, m.migrations = 16, 1
    assert verdict(m) == {
        "path": "remote",
        "cached_tokens": 64,
        "from_memory": 32,
        "from_disk": 16,
        "from_prefill_agent": 16,  # what the prefill agent's cache held past ours
        "migrations": 1,
    }
    m.method = "local-fallback"
    assert "migrations" not in verdict(m, final=False)  # a stream's header: not known yet
    assert parse(header_value(m))["path"] == "local-after-failure"
    assert parse(header_value(Metrics(method="disaggregated")))["cached_tokens"] == "0"


class Forcing(Router):
    """Each served name's requests with the placement that makes its path run (the
    path itself runs for real: the agents choose nothing else)."""

    def run(self, model: str | None, request: GenerateRequest, *a: Any, **kw: Any) -> Any:
        assert model is not None
        return super().run(model, request.replace(placement=PLACE[model]), *a, **kw)


@pytest.fixture(scope="module")
def forcing_gateway(smol_set: AgentSet) -> Iterator[Gateway]:
    p, d = smol_set.prefill, smol_set.decodes[0]
    live = Endpoint(p.name, p.host, p.port, p.control_port)
    dead = Endpoint("gone", "127.0.0.1", free_port())  # nothing listens: a fallback
    decode = [Endpoint(d.name, d.host, d.port, d.control_port)]
    routes = [
        Route("remote", [live], decode, integrity="none"),
        Route("local", [live], decode, integrity="none"),
        Route("fallback", [dead], decode, integrity="none"),
    ]
    client = PooledClient(router=Forcing(routes, token=p.token))
    client.model_dirs = {name: smol_set.key.model for name in RUNS}
    gw = start_gateway(client)
    yield gw
    gw.stop()


ASK = "What is the capital of France?"


def calls(model: str, stream: bool) -> list[tuple[str, dict[str, Any]]]:
    """Each API's request for `model`: (path, body)."""
    chat = [{"role": "user", "content": ASK}]
    return [
        ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 4}),
        ("/v1/messages", {"model": model, "messages": chat, "max_tokens": 4}),
        ("/v1/responses", {"model": model, "input": ASK, "max_output_tokens": 4}),
        ("/api/chat", {"model": model, "messages": chat, "options": {"num_predict": 4}}),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", list(RUNS))
def test_every_api_says_which_path_ran(forcing_gateway: Gateway, model: str, stream: bool) -> None:
    for path, body in calls(model, stream):
        with httpx.Client(base_url=forcing_gateway.url, timeout=120) as http:
            extra: dict[str, Any] = {"stream": stream}
            if stream and path == "/v1/chat/completions":
                extra["stream_options"] = {"include_usage": True}
            r = http.post(path, json={**body, **extra})
            assert r.status_code == 200, (path, r.text)
            said = parse(r.headers[HEADER])
            assert said["path"] == RUNS[model], (path, said)
            assert said["cached_tokens"].isdigit()
            assert ("migrations" in said) is not stream  # a stream's header is sent early
            if path == "/v1/chat/completions" and not stream:
                # true: what the decode agent reported
                assert PATHS[r.json()["disagg_metrics"]["method"]] == said["path"]
            if path != "/api/chat" and not stream:  # the APIs with a usage object
                in_body = {k: str(v) for k, v in r.json()["usage"]["disagg_verdict"].items()}
                assert in_body == said
            if stream and path == "/v1/chat/completions":
                # The last usage chunk: the whole answer's verdict, migrations included.
                events = [json.loads(x[6:]) for x in r.text.split("\n") if x[6:7] == "{"]
                last = next(e["usage"] for e in reversed(events) if e.get("usage"))
                assert last["disagg_verdict"]["path"] == said["path"]
                assert last["disagg_verdict"]["migrations"] == 0
            if stream:
                assert r.text  # the whole stream came after the held-back start
            else:
                json.loads(r.text)


def streamed_app(chunks: list[Chunk | Exception]) -> Any:
    """An app whose one route streams `chunks` (an exception: raised there) as text
    lines, the way a door renders them, catching a failure into its last line."""
    from fastapi import FastAPI

    app = FastAPI()

    async def source() -> AsyncIterator[Chunk]:
        for c in chunks:
            if isinstance(c, Exception):
                raise c
            yield c

    async def render(seen: AsyncIterator[Chunk]) -> AsyncIterator[str]:
        yield "start\n"  # what a door sends before any chunk (OpenAI's role delta)
        try:
            async for c in seen:
                yield f"text {c.text}\n"
        except RuntimeError as e:
            yield f"error {e}\n"

    @app.get("/s")
    async def s() -> Any:
        return streamed(render, source(), media_type="text/plain")

    return app


def test_a_stream_holds_its_start_for_the_first_tokens_metrics() -> None:
    from fastapi.testclient import TestClient

    first = Chunk("", metrics=Metrics(method="local-fallback", cached_tokens=32))
    chunks: list[Chunk | Exception] = [first, Chunk("Paris"), Chunk(".")]
    with TestClient(streamed_app(chunks)) as http:
        r = http.get("/s")
    assert parse(r.headers[HEADER]) == {
        "path": "local-after-failure",
        "cached_tokens": "32",
        "from_memory": "32",
        "from_disk": "0",
        "from_prefill_agent": "0",
    }
    assert r.text == "start\ntext \ntext Paris\ntext .\n"  # every byte, in order


def test_a_stream_that_fails_before_any_token_still_answers() -> None:
    from fastapi.testclient import TestClient

    with TestClient(streamed_app([RuntimeError("no decode agent")])) as http:
        r = http.get("/s")
    assert r.status_code == 200 and HEADER not in r.headers  # nothing ran: no verdict
    assert r.text == "start\nerror no decode agent\n"

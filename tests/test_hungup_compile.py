"""A client that hangs up while its grammar compiles, on a real decode agent
(run from tests/slowgrammar.py: each compile 4 s late): the request ends within a
poll of the hang-up, counted cancelled; the abandoned compile is not cached; the
agent answers the next requests, the same schema included."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from disagg.serving import wireclient as client
from disagg.serving.localagents import AgentProc, make_token_file, wait_ready
from tests.conftest import Spawn

pytestmark = [pytest.mark.fault, pytest.mark.slow]

DELAY_S = 4.0
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["colour"],
}


@pytest.fixture(scope="module")
def decode(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory, spawn_module: Spawn
) -> AgentProc:
    token_file, token = make_token_file(tmp_path_factory.mktemp("hungup"))
    proc, log, name = spawn_module(
        "decode",
        default_model,
        module="tests.slowgrammar",
        extra_args=["--compile-delay", str(DELAY_S), "--token-file", str(token_file)],
    )
    agent = wait_ready("decode", proc, log, name, 300)
    agent.token = token
    return agent


def request(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Name a colour.", "max_tokens": 12, "placement": "local", **fields}


def constrained() -> dict[str, Any]:
    return request(response_format={"type": "json_schema", "schema": SCHEMA, "strict": True})


def wait(what: Any, seconds: float) -> float:
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < seconds, "timed out"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_hung_up_compile_ends_its_request_and_is_not_cached(decode: AgentProc) -> None:
    before = decode.status()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017, PT011  # the client's own timeout: it hangs up
        client.generate(decode.host, decode.port, constrained(), token=decode.token, deadline_s=0.8)
    hung_up = time.monotonic() - t0
    assert hung_up < DELAY_S - 1, "the client did not hang up before the compile ended"
    # The agent stops waiting within a poll or two, long before the compile would end.
    took = wait(lambda: decode.status()["in_flight"] == 0, DELAY_S)
    assert hung_up + took < DELAY_S - 1, (hung_up, took)
    after = decode.status()
    assert after["cancelled"] == before["cancelled"] + 1 and after["errors"] == before["errors"]
    # The compile itself runs out on its pool thread; nobody waits, so it is dropped.
    wait(lambda: decode.status()["grammars"]["compiling"] == 0, 30)
    assert decode.status()["grammars"]["cached"] == before["grammars"]["cached"]
    # The agent goes on: a plain request, and the same schema waited for this time.
    plain = client.generate(decode.host, decode.port, request(), token=decode.token)
    assert plain.text and plain.finish_reason in ("stop", "length")
    kept = client.generate(decode.host, decode.port, constrained(), token=decode.token)
    assert json.loads(kept.text)["colour"] in ("red", "green", "blue")
    assert decode.status()["grammars"]["cached"] == before["grammars"]["cached"] + 1

"""A client that hangs up while its grammar compiles, on a real decode agent
(run from tests/slowgrammar.py: each compile 4 s late): the request ends while the
compile still runs, counted cancelled; the abandoned compile is not cached; the
agent answers the next requests, the same schema included."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import RequestTimeout
from disagg.serving import wireclient as client
from disagg.serving.localagents import AgentProc, make_token_file, wait_ready
from tests.conftest import Spawn

pytestmark = [pytest.mark.fault, pytest.mark.slow]

DELAY_S = 3.0  # each compile late by this: over three times the client's 0.8 s deadline
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


def wait(what: Any, seconds: float) -> Any:
    """The first truthy value of what(); a hang guard past `seconds`."""
    deadline = time.monotonic() + seconds
    while not (got := what()):
        if time.monotonic() > deadline:
            pytest.fail(f"not seen in {seconds} s")
        time.sleep(0.05)
    return got


def test_a_hung_up_compile_ends_its_request_and_is_not_cached(decode: AgentProc) -> None:
    before = decode.status()
    with pytest.raises(RequestTimeout, match="deadline of 0.8s"):  # the client hangs up
        client.generate(decode.host, decode.port, constrained(), token=decode.token, deadline_s=0.8)
    # Orderings, not times: the request ended while its compile still ran.
    ended = wait(lambda: (s := decode.status())["in_flight"] == 0 and s, 60)
    assert ended["grammars"]["compiling"] == 1, "the agent waited for the compile to end"
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

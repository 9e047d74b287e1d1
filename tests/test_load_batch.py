"""A local prefill beside decoding streams, on a real decode agent process: the
prompt goes through in chunks with decode steps between them, so a stream on the
same agent keeps getting tokens while another request's long prompt is prefilled."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disagg.serving.localagents import AgentProc
from tests.conftest import PairFactory, ask
from tests.tinymodels import PROMPT

pytestmark = pytest.mark.slow


class Stop(Exception):
    """Raised from the stream's callback: ends it (the agent sees the client go)."""


@pytest.fixture(scope="module")
def decode(tiny_model: Callable[..., Path], agent_pair: PairFactory) -> AgentProc:
    return agent_pair(tiny_model("llama", seed=2))[1]


def long_prompt(words: int) -> str:
    base = PROMPT.split()
    return " ".join(base[i % len(base)] for i in range(words))


def test_a_stream_keeps_getting_tokens_while_the_agent_prefills_a_long_prompt(
    decode: AgentProc,
) -> None:
    arrivals: list[float] = []
    started = threading.Event()
    stop = threading.Event()
    outcome: list[BaseException] = []

    def on_token(_: dict[str, Any]) -> None:
        arrivals.append(time.time())
        if len(arrivals) >= 3:
            started.set()
        if stop.is_set():
            raise Stop

    def stream() -> None:
        req = {"prompt": PROMPT, "raw": True, "max_tokens": 3500, "ignore_eos": True}
        try:
            ask(decode, req, on_token=on_token, timeout_s=600)
        except Stop:
            pass
        except BaseException as e:  # reported below
            outcome.append(e)

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        assert started.wait(120), "the first stream produced no tokens"
        # No prefill agent named: the decode agent prefills this prompt itself.
        req = {"prompt": long_prompt(1500), "raw": True, "max_tokens": 2, "ignore_eos": True}
        res = ask(decode, req, timeout_s=600)
    finally:
        stop.set()
        streamer.join(120)
    assert not outcome, outcome
    m = res.metrics
    assert m["method"] == "decode-only" and m["prompt_tokens"] > 1000
    t = m["timeline"]
    begin, end = t["at"] + t["prefill_start"], t["at"] + t["prefill_end"]
    during = [a for a in arrivals if begin < a < end]
    # Prefilled as one task (as before), the stream would get at most the token or
    # two of the steps queued around it; interleaved, one per chunk of the prompt.
    assert len(during) >= 8, (len(during), end - begin, len(arrivals))
    assert arrivals[-1] > end  # still streaming after the prefill: it was beside it throughout

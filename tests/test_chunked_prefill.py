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
from disagg_agents.wire.timeline import Timeline
from tests.conftest import PairFactory, ask
from tests.tinymodels import PROMPT, shared_tiny

pytestmark = pytest.mark.slow


class Stop(Exception):
    """Raised from the stream's callback: ends it (the agent sees the client go)."""


@pytest.fixture(scope="module")
def decode(tiny_model: Callable[..., Path], agent_pair: PairFactory) -> AgentProc:
    return agent_pair(shared_tiny("llama"))[1]


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
    assert m.method == "decode-only" and (m.prompt_tokens or 0) > 1000
    t = m.timeline or Timeline()
    at = t.at or 0.0
    begin, end = at + (t.prefill_start or 0.0), at + (t.prefill_end or 0.0)
    during = [a for a in arrivals if begin < a < end]
    # Prefilled as one task (as before), the stream gets nothing while the prompt
    # computes, only tokens queued before it or stepped after it: the interval's
    # middle stays empty. Interleaved, tokens come throughout, one per chunk.
    third = (end - begin) / 3
    per_third = [
        sum(begin + k * third < a <= begin + (k + 1) * third for a in during) for k in range(3)
    ]
    assert all(per_third), (per_third, end - begin, len(arrivals))
    assert arrivals[-1] > end  # still streaming after the prefill: it was beside it throughout


def test_the_greedy_first_token_off_the_loop_is_the_loops_own() -> None:
    """Read off the logits on the request's thread, the first token is the one the
    mlx loop samples (argmax of logprobs); a near tie goes back to the loop."""
    import numpy as np

    from disagg_agents.decode.firsttoken import first_token, greedy_first
    from disagg_agents.decode.loop import DecodeLoop

    loop = DecodeLoop(model=None)
    rng = np.random.default_rng(3)
    for _ in range(20):
        logits = (rng.standard_normal(4096) * 8).astype(np.float32)
        allowed = rng.random(4096) < 0.5
        for mask in (None, allowed):
            tid = greedy_first(logits, mask)
            assert tid is not None and tid == loop.call(first_token, logits, None, False, mask)[0]
    tie = np.zeros(16, np.float32)
    tie[[3, 9]] = 5.0
    assert greedy_first(tie, None) is None


def test_a_seeded_row_samples_the_same_whoever_shares_the_batch() -> None:
    import mlx.core as mx
    import numpy as np

    from disagg_agents.decode.loop import make_sampler, sample_rows

    x = mx.random.normal((5, 300), key=mx.random.key(0))
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    mine = make_sampler(0.8, 0.9, 7)
    alone = [int(np.array(sample_rows(lp[2:3], [mine]))[0]) for _ in range(6)]
    mates = [None, make_sampler(1.0, 1.0, 1), make_sampler(0.8, 0.9, 7), None, None]
    together = [np.array(sample_rows(lp, mates)).tolist() for _ in range(6)]
    assert [row[2] for row in together] == alone
    greedy = np.array(mx.argmax(lp, axis=-1)).tolist()
    assert all([row[i] for i in (0, 3, 4)] == [greedy[i] for i in (0, 3, 4)] for row in together)


def test_tokens_queued_behind_a_lagging_client_go_out_together() -> None:
    import queue

    from disagg_agents.decode.tokenframes import Item, bursts

    q: queue.Queue[Item | Exception | None] = queue.Queue()
    for t in (1, 2, 3):
        q.put((t, None))
    q.put(None)
    assert list(bursts(q)) == [[(1, None), (2, None), (3, None)]]
    q.put((4, None))
    q.put(RuntimeError("the output grammar failed"))
    got = bursts(q)
    assert next(got) == [(4, None)]
    with pytest.raises(RuntimeError, match="grammar"):
        next(got)

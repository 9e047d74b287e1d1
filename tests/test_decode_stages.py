"""Each decode stage runs on what it is given, nothing else: stand-ins for the
engine, the mlx thread, the prefix cache, placement and the client's socket
(the real ones need a model and Metal), the stage's own code real. The agent
wires the real ones (disagg_agents.decode.agent); tests/test_agents_tiny.py runs
them end to end."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from disagg_agents.chatformat import Piece
from disagg_agents.decode import events, firsttoken, prompt, stream
from disagg_agents.decode.codectuner import CodecTuners
from disagg_agents.decode.engine import BadRequest
from disagg_agents.decode.job import Job
from disagg_agents.decode.kvsource import KVSource
from disagg_agents.decode.prefixcache import Hit
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.channel import recv_json
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.request import GenerateRequest

VOCAB = 16


class Loop:
    """The mlx thread's stand-in: everything runs on the caller's thread; a
    joined row's tokens are `tokens`, then its end."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens = tokens or []
        self.chunks: list[tuple[int, int]] = []
        self.joined: list[Any] = []

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def prefill(self, chunk: Callable[[int, int], None], start: int, end: int) -> Future[None]:
        self.chunks.append((start, end))
        chunk(start, end)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def join(self, seq: Any) -> None:
        self.joined.append(seq)
        for tid in self.tokens:
            seq.out.put((tid, None))
        seq.out.put(None)


class Model:
    """A model that reads ids and says `favourite` next, with no cache of its own."""

    def __init__(self, favourite: int) -> None:
        self.favourite = favourite
        self.seen: list[list[int]] = []

    def make_cache(self) -> list[Any]:
        return []

    def __call__(self, ids: mx.array, cache: list[Any]) -> mx.array:
        self.seen.append(np.array(ids[0]).tolist())
        logits = np.zeros((1, ids.shape[1], VOCAB), np.float32)
        logits[:, :, self.favourite] = 5.0
        return mx.array(logits)


class Parser:
    """The answer's parser: each token's text is `t<id>`."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[Any] = []

    def add(self, tid: int) -> list[Piece]:
        self.content.append(f"t{tid}")
        return [Piece("content", f"t{tid}")]

    def finish(self, cut: bool) -> list[Piece]:
        return []


@dataclass
class Prefix:
    """The prefix cache's stand-in: never a hit; records what it was shown."""

    store: Any = field(default_factory=lambda: SimpleNamespace(block=16, max_bytes=0))
    shown: list[Hit] = field(default_factory=list)

    def lookup(self, namespace: str, ids: list[int], local: bool, salt: str | None) -> Hit:
        return Hit(namespace, [], [], self.store.block)

    def record(self, hit: Hit, caches: list[Any]) -> None:
        self.shown.append(hit)


@dataclass
class Placement:
    """Placement's stand-in: says `where`; records what it learned."""

    where: str = "remote"
    learned: list[tuple[str, float]] = field(default_factory=list)

    def choose(self, key: str, n: int, cached: int) -> tuple[str, str]:
        return self.where, "the stand-in says so"

    def observe_local(self, tokens: int, seconds: float) -> None:
        self.learned.append(("local", tokens / seconds))

    def observe_step(self, seconds: float) -> None:
        self.learned.append(("step", seconds))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    with ours, theirs:
        yield ours, theirs


def request(**fields: Any) -> GenerateRequest:
    return GenerateRequest.from_dict({"prompt": "hi", "max_tokens": 8, **fields})


def job_for(req: GenerateRequest, sock: socket.socket, ids: list[int]) -> Job:
    job = Job(req, sock, None, time.perf_counter(), time.time())
    job.prompt_ids = job.input_ids = ids
    job.max_tokens = req.max_tokens
    job.metrics = Metrics(prompt_tokens=len(ids), cached_tokens=0)
    return job


def engine(context: int = 64) -> Any:
    grammars = SimpleNamespace(matcher=lambda *a, **k: None)
    return SimpleNamespace(
        encode=lambda req: [3, 4, 5, 6],
        context=context,
        grammars=grammars,
        chat=SimpleNamespace(reasoning=False, kind="plain"),
        is_chat=lambda req: False,
        format_kind="plain",
        think_start=None,
        think_end=None,
        model=Model(favourite=7),
        stream=lambda req, ids: Parser(),
        stops=lambda req: frozenset({2}),
    )


def test_the_prompt_stage_opens_a_job_from_the_engine_alone(pair: Any) -> None:
    job = prompt.open_job(engine(context=10), "decode-x", request(), pair[0], None)
    assert (job.prompt_ids, job.input_ids, job.matcher) == ([3, 4, 5, 6], [3, 4, 5, 6], None)
    assert job.max_tokens == 6  # the context's 10 less the prompt's 4
    assert (job.metrics.prompt_tokens, job.metrics.decode_server) == (4, "decode-x")
    with pytest.raises(BadRequest, match="the prompt is 4 tokens; the model's context is 4"):
        prompt.open_job(engine(context=4), "decode-x", request(), pair[0], None)


def kv_source(eng: Any, loop: Any, prefix: Any, placement: Any) -> KVSource:
    blas: Any = SimpleNamespace(shared=None, prefills=0, prefilling=None)
    return KVSource(eng, loop, prefix, placement, CodecTuners(), blas, "decode-x")


def test_the_kv_source_prefills_here_with_its_collaborators(pair: Any) -> None:
    eng, loop, prefix = engine(), Loop(), Prefix()
    src = kv_source(eng, loop, prefix, Placement())
    job = job_for(request(), pair[0], [3, 4, 5, 6])
    src.prompt_kv(job)
    assert job.metrics.method == "decode-only"  # no prefill agent named
    assert loop.chunks == [(0, 3)]  # all but the last position, through the loop
    assert eng.model.seen == [[3, 4, 5], [6]]
    assert job.logits is not None and int(np.argmax(job.logits)) == 7
    assert [h.namespace for h in prefix.shown] == ["local"]


def test_the_kv_source_asks_placement_and_its_codec_tuner(pair: Any) -> None:
    src = kv_source(engine(), Loop(), Prefix(), Placement(where="local"))
    prefill = {"hosts": ["127.0.0.1"], "port": 9}
    job = job_for(request(prefill=prefill, codec="auto"), pair[0], [3, 4, 5, 6])
    src.prompt_kv(job)  # placement says local: no prefill agent is dialled
    assert (job.metrics.method, job.metrics.placement) == ("local", "local")
    assert job.metrics.placement_reason == "the stand-in says so"
    assert job.metrics.codec_reason == "link not measured yet"  # the link's new tuner
    assert src.tuners.for_link("127.0.0.1:9") is src.tuners.for_link("127.0.0.1:9")
    assert job.logits is not None and int(np.argmax(job.logits)) == 7


def test_the_first_token_stage_reads_the_logits_and_opens_the_parser(pair: Any) -> None:
    eng, loop = engine(), Loop()
    job = job_for(request(), pair[0], [3, 4, 5, 6])
    job.logits = np.eye(VOCAB, dtype=np.float32)[9] * 4
    firsttoken.first(eng, loop, Prefix(), job)  # type: ignore[arg-type]
    assert (job.first_id, job.first_logprobs) == (9, None)
    assert isinstance(job.parser, Parser) and job.saves == []  # the stand-in store keeps none
    early = job.first_frame_metrics
    assert early is not None and early.ttft == pytest.approx(job.t_first - job.t0)


def frames(sock: socket.socket, kind: Frame, n: int) -> list[dict[str, Any]]:
    return [recv_json(sock, kind)[1] for _ in range(n)]


def test_the_decode_stage_sends_each_token_the_loop_gives(pair: Any) -> None:
    ours, theirs = pair
    loop = Loop(tokens=[11, 12, 2])  # 2: the stand-in engine's stop
    job = job_for(request(), ours, [3, 4, 5, 6])
    parser: Any = Parser()
    job.first_id, job.parser, job.first_frame_metrics = 10, parser, Metrics(ttft=0.5)
    stream.decode(loop, engine().stops, job)  # type: ignore[arg-type]
    assert job.out == [10, 11, 12, 2] and job.seq is loop.joined[0]
    sent = frames(theirs, Frame.TOKEN, 4)
    assert [f["text"] for f in sent] == ["t10", "t11", "t12", "t2"]
    assert sent[0]["metrics"]["ttft"] == 0.5 and "metrics" not in sent[1]


def test_the_events_stage_says_done_and_teaches_placement(pair: Any) -> None:
    ours, theirs = pair
    placement = Placement()
    job = job_for(request(max_tokens=3), ours, [3, 4, 5, 6])
    parser: Any = Parser()
    parser.content = ["t10", "t11", "t12"]
    job.parser, job.out = parser, [10, 11, 12]
    job.metrics.method, job.metrics.prefill_time = "local", 0.2
    job.t_local, job.t_prefilled = job.t0, job.t0 + 0.2
    job.t_first = job.t0 + 0.25
    events.finish(placement, job)  # type: ignore[arg-type]
    done = frames(theirs, Frame.DONE, 1)[0]
    assert (done["text"], done["token_ids"]) == ("t10t11t12", [10, 11, 12])
    assert done["metrics"]["finish_reason"] == "length"  # 3 tokens of max_tokens 3
    assert [k for k, _ in placement.learned] == ["local", "step"]
    assert placement.learned[0][1] == pytest.approx(4 / 0.2)


def finished_timeline(sock: socket.socket, peer: socket.socket, **how: Any) -> dict[str, Any]:
    """The DONE frame's timeline of a one-token answer (it never joined the batch)."""
    job = job_for(request(max_tokens=1), sock, [3, 4, 5, 6])
    parser: Any = Parser()
    job.parser, job.out = parser, [10]
    job.metrics.prefill_time, job.metrics.prefill_queue_time = 0.2, 0.05
    job.t_first = job.t0 + 0.3
    for name, value in how.items():
        setattr(job, name, value(job.t0))
    events.finish(Placement(), job)  # type: ignore[arg-type]
    timeline: dict[str, Any] = frames(peer, Frame.DONE, 1)[0]["metrics"]["timeline"]
    assert timeline["at"] == job.at and timeline["done"] == round(job.t_end - job.t0, 6)
    assert timeline["first_token"] == pytest.approx(0.3)
    return timeline


def test_the_events_stage_names_the_phases_the_request_had(pair: Any) -> None:
    # Remote, no K/V layer arrived (kvfetch's marks): the K/V phases named, null.
    remote = finished_timeline(
        *pair, marks=lambda t0: {"sent": t0 + 0.01, "kv_first": None, "kv_last": None}
    )
    phases = ["prefill_start", "prefill_end", "kv_first", "kv_last", "first_token"]
    assert list(remote) == ["at", *phases, "joined", "done"]
    assert (remote["kv_first"], remote["kv_last"], remote["joined"]) == (None, None, None)
    assert remote["prefill_start"] == pytest.approx(0.06)  # sent + the prefill's queue
    assert remote["prefill_end"] == pytest.approx(0.26)
    # Prefilled here: no K/V phases at all.
    local = finished_timeline(*pair, t_local=lambda t0: t0 + 0.02, t_prefilled=lambda t0: t0 + 0.22)
    assert list(local) == ["at", "prefill_start", "prefill_end", "first_token", "joined", "done"]
    assert (local["prefill_start"], local["prefill_end"]) == pytest.approx((0.02, 0.22))

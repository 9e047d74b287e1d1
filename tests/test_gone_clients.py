"""Work for a client that is gone stops everywhere: the prefill agent's queue drops
a prompt whose requester hung up or whose wait passed, before it starts, and a
forward between layers; the decode agent's wait for K/V ends when its own client
leaves, a local prefill is refused then and stops between chunks; the gateway's
wire client closes at once on cancel; placement is not taught by one burst; a
key's queued prompt tokens count against its share."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from disagg.errors import Overloaded
from disagg.frontends import tenancy
from disagg.frontends.workers import Workers, charge
from disagg.serving import wireclient
from disagg_agents.decode import placement
from disagg_agents.decode.placement import HANDSHAKE_MAX_S, QUEUE_MAX_S, Placement
from disagg_agents.prefill.queue import Dropped, FairQueue
from disagg_agents.wire.request import GenerateRequest, PrefillRequest, RequestError
from tests.conftest import PairFactory, log_since, log_size
from tests.gateways import client_over
from tests.slowprefill import SLOW_LAYER_S, SLOW_SET
from tests.tinymodels import PROMPT, shared_tiny

HANG_S = 30.0  # hang guard for waits that end in well under a second


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_S  # hang guard
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


# --- the prefill agent's queue -------------------------------------------------


class Holder:
    """A thread holding the queue's slot until `release`."""

    def __init__(self, q: FairQueue) -> None:
        self.go = threading.Event()
        self.inside = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(q,), daemon=True)
        self.thread.start()
        assert self.inside.wait(HANG_S)

    def _run(self, q: FairQueue) -> None:
        with q.slot(100):
            self.inside.set()
            self.go.wait(HANG_S)

    def release(self) -> None:
        self.go.set()
        self.thread.join(HANG_S)


def waiter(
    q: FairQueue, name: str, ran: list[str], out: dict[str, Dropped], **kw: Any
) -> threading.Thread:
    def run() -> None:
        try:
            with q.slot(100, **kw):
                ran.append(name)
        except Dropped as e:
            out[name] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_waiter_whose_requester_hung_up_leaves_the_line_before_its_turn() -> None:
    q = FairQueue()
    holder = Holder(q)
    left, ran, out = threading.Event(), list[str](), dict[str, Dropped]()
    a = waiter(q, "a", ran, out, gone=left.is_set)
    b = waiter(q, "b", ran, out, gone=lambda: False)
    wait_for(lambda: q.snapshot()["waiting"] == 2, "two waiters")
    left.set()
    a.join(HANG_S)
    # Dropped while the device was still busy: it never waited for its turn.
    assert isinstance(out["a"], Dropped) and out["a"].reason == "gone"
    assert "requester hung up" in str(out["a"])
    assert q.snapshot()["waiting"] == 1 and q.busy
    holder.release()
    b.join(HANG_S)
    assert ran == ["b"]
    snap = q.snapshot()
    assert snap["dropped_gone"] == 1 and snap["waiting"] == 0 and not snap["busy"]


def test_a_waiter_past_its_deadline_is_dropped_and_the_slot_goes_on() -> None:
    q = FairQueue()
    holder = Holder(q)
    ran: list[str] = []
    out: dict[str, Dropped] = {}
    a = waiter(q, "a", ran, out, deadline=time.monotonic() + 0.3)
    a.join(HANG_S)
    assert out["a"].reason == "deadline" and q.busy
    holder.release()
    with q.slot(10):  # the holder's release left the device free
        ran.append("next")
    assert ran == ["next"] and q.snapshot()["dropped_deadline"] == 1


def test_a_requester_gone_when_its_turn_comes_is_not_run() -> None:
    q = FairQueue()
    holder = Holder(q)
    left, ran, out = threading.Event(), list[str](), dict[str, Dropped]()
    a = waiter(q, "a", ran, out, gone=left.is_set)
    wait_for(lambda: q.snapshot()["waiting"] == 1, "a waiting")
    b = waiter(q, "b", ran, out)
    wait_for(lambda: q.snapshot()["waiting"] == 2, "b waiting")
    left.set()  # a hangs up as the slot is handed to it
    holder.release()
    a.join(HANG_S)
    b.join(HANG_S)
    assert ran == ["b"] and out["a"].reason == "gone"
    assert not q.busy


def test_a_gone_requester_is_refused_by_an_idle_device() -> None:
    q = FairQueue()
    with pytest.raises(Dropped, match="hung up"), q.slot(10, gone=lambda: True):
        pytest.fail("ran for nobody")
    with q.slot(10):  # and the device is free
        assert q.busy
    assert not q.busy


def test_a_forward_stops_between_layers_once_its_requester_hung_up() -> None:
    """The prefill engine's layer hook, on stand-in layers: it hands each layer
    on, and stops the forward after a layer once `gone()` is true."""
    import torch

    from disagg_agents.prefill.engine import PrefillEngine

    eng: Any = PrefillEngine.__new__(PrefillEngine)
    eng.kinds, eng.dtype, eng.copies = [("full", None)] * 4, "float32", None
    eng.layers = [object()] * 4
    kv = torch.zeros(1, 2, 5, 8)
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=kv, values=kv)] * 4)
    got: list[int] = []
    calls = [0]

    def gone() -> bool:
        calls[0] += 1
        return len(got) >= 2  # hung up while layer 1 ran

    hook = eng._hand_over(cache, 5, lambda layer: got.append(layer.layer), False, {}, gone)
    hook(0)(None, None, None)
    with pytest.raises(Dropped, match="prefill stopped after layer 1"):
        for i in range(1, 4):
            hook(i)(None, None, None)
    assert got == [0, 1]


def test_a_prefill_request_carries_its_wait() -> None:
    req = PrefillRequest([1, 2, 3], wait_s=12.5)
    assert PrefillRequest.from_dict(req.to_wire()).wait_s == 12.5
    assert "wait_s" not in PrefillRequest([1, 2]).to_wire()  # older agents never see it
    for bad in (0, -1, "5", True, float("inf"), 1e9):
        with pytest.raises(RequestError, match="wait_s"):
            PrefillRequest.from_dict({"token_ids": [1], "wait_s": bad})


# --- the decode agent ----------------------------------------------------------


def test_the_wait_for_kv_ends_when_our_client_hangs_up(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    from disagg_agents.decode.kvfetch import await_frame
    from disagg_agents.runtime.hangup import HungUp, client_gone

    link, _prefill_end = pair  # the prefill agent sends nothing: the prompt is queued
    client, client_end = socket.socketpair()
    link.settimeout(HANG_S)
    threading.Timer(0.3, client_end.close).start()
    with pytest.raises(HungUp, match="waited for the prefill agent"):
        await_frame(link, lambda: client_gone(client))
    client.close()
    link.settimeout(0.3)
    with pytest.raises(TimeoutError):  # a live client: the link's own timeout still holds
        await_frame(link, lambda: False)


class CountingModel:
    """A stand-in model for the decode loop: counts its calls; `on_call(n)` runs
    at the n-th."""

    def __init__(self, on_call: Callable[[int], None] = lambda n: None) -> None:
        self.calls = 0
        self.on_call = on_call

    def __call__(self, x: Any, cache: Any = None) -> Any:
        import mlx.core as mx

        self.calls += 1
        self.on_call(self.calls)
        return mx.zeros((1, x.shape[1], 8))


def local_job(model: CountingModel, client: socket.socket, n_ids: int) -> tuple[Any, Any]:
    """A stand-in decode agent (a real DecodeLoop, 4-token chunks) and a job."""
    from disagg_agents.decode.job import Job
    from disagg_agents.decode.loop import DecodeLoop

    prefix = SimpleNamespace(store=SimpleNamespace(block=16), record=lambda hit, caches: None)
    agent = SimpleNamespace(
        engine=SimpleNamespace(model=model),
        loop=DecodeLoop(model, prefill_step=4),
        prefix=prefix,
    )
    req = GenerateRequest(prompt="x", prefix_cache=False)
    job = Job(req, client, None, time.perf_counter(), time.time(), input_ids=list(range(n_ids)))
    return agent, job


def test_a_local_prefill_stops_between_chunks_when_its_client_hangs_up(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    from disagg_agents.decode.kvsource import local_prefill
    from disagg_agents.runtime.hangup import HungUp

    client, client_end = pair
    model = CountingModel(lambda n: client_end.close() if n == 2 else None)
    agent, job = local_job(model, client, 41)  # 40 positions: 10 chunks of 4
    with pytest.raises(HungUp, match="local prefill stopped at 8 of 41"):
        local_prefill(agent, job)
    assert model.calls == 2


def test_a_local_prefill_is_refused_when_its_client_is_gone(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    from disagg_agents.decode.kvsource import local_prefill
    from disagg_agents.runtime.hangup import HungUp

    client, client_end = pair
    model = CountingModel()
    agent, job = local_job(model, client, 41)
    client_end.close()
    with pytest.raises(HungUp, match="before its local prefill began"):
        local_prefill(agent, job)
    assert model.calls == 0
    # A live client's prefill runs every chunk, then the last position.
    live, live_end = socket.socketpair()
    try:
        agent, job = local_job(model, live, 41)
        assert local_prefill(agent, job).shape == (8,)
        assert model.calls == 11
    finally:
        live.close()
        live_end.close()


# --- the gateway's wire client ---------------------------------------------------


def test_the_wire_client_stops_waiting_once_cancelled(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    link, _agent_end = pair  # the decode agent sends nothing yet (PROGRESS aside)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    with pytest.raises(wireclient.Cancelled):
        wireclient._recv(link, HANG_S, None, "agent", None, cancel)
    with pytest.raises(TimeoutError):  # not cancelled: the idle deadline holds
        wireclient._recv(link, 0.3, None, "agent", None, threading.Event())


# --- placement -------------------------------------------------------------------

QUICK = {"prefill_time": 0.5, "kv_fetch_time": 0.52, "kv_bytes": 30_000, "kv_transfer_time": 0.01}
# The finding: a fetch that waited 53.9 s in a busy prefill agent's queue.
BURST = {**QUICK, "kv_fetch_time": 54.5, "prefill_queue_time": 53.9}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(placement.time, "monotonic", lambda: now[0])
    return now


def remote_ms(why: str, part: str) -> float:
    """A figure of the reason's text, e.g. part "handshake" in "... 20.0 ms handshake"."""
    import re

    found = re.search(rf"([\d,.]+) ms {part}", why)
    assert found, why
    return float(found.group(1).replace(",", ""))


def test_a_queue_wait_is_not_taught_as_the_links_handshake(clock: list[float]) -> None:
    p = Placement()
    p.observe_local(1000, 2.0)
    p.observe_remote("a:1", 1000, 30, {**BURST, "prefill_queue_waiting": 5})
    _, why = p.choose("a:1", 1000)
    assert remote_ms(why, "handshake") == pytest.approx(100, abs=1)  # 54.5 - 0.5 - 53.9 s
    assert remote_ms(why, "queue") == QUEUE_MAX_S * 1e3  # the wait, bounded
    # Without the queue's own figure (an older prefill agent), the gap is bounded.
    old = Placement()
    old.observe_local(1000, 2.0)
    old.observe_remote("a:1", 1000, 30, {**QUICK, "kv_fetch_time": 54.5})
    assert remote_ms(old.choose("a:1", 1000)[1], "handshake") == HANDSHAKE_MAX_S * 1e3


def test_a_burst_decays_and_the_prompt_goes_remote_again(clock: list[float]) -> None:
    p = Placement()
    p.observe_local(1000, 2.0)  # 500 tok/s here: 2 s for 1,000 tokens
    p.observe_remote("a:1", 1000, 30, {**BURST, "prefill_queue_waiting": 5})
    assert p.choose("a:1", 1000)[0] == "local"  # the burst's line is still there
    clock[0] += 30  # six half-lives: 30 s of queue is ~0.5 s
    where, why = p.choose("a:1", 1000)
    assert where == "remote" and remote_ms(why, "queue") < 600, why


def test_an_idle_prefill_agent_takes_prompts_again_at_once(clock: list[float]) -> None:
    p = Placement()
    p.observe_local(1000, 2.0)
    # The same wait, but the prefill agent says nobody waits behind it now.
    p.observe_remote("a:1", 1000, 30, {**BURST, "prefill_queue_waiting": 0})
    where, why = p.choose("a:1", 1000)
    assert where == "remote" and "queue" not in why, why


# --- the gateway's share of prompt tokens ----------------------------------------


def submit_as(pool: Workers, tenant: bytes, tokens: int, gate: threading.Event) -> tuple[Any, Any]:
    """Submit a request of `tenant` with a `tokens`-token prompt that runs until
    `gate` is set; (its future, its charge)."""
    mark = tenancy.enter(tenant)
    try:
        cost = charge(tokens)
        return pool.submit(gate.wait, HANG_S), cost
    finally:
        tenancy.leave(mark)


def test_a_keys_queued_prompt_tokens_count_against_its_share() -> None:
    pool = Workers(4, limit=10, per_key=10, per_key_tokens=1000)
    gate = threading.Event()
    try:
        first, first_cost = submit_as(pool, b"A", 5000, gate)  # alone: however long
        with pytest.raises(Overloaded, match="5000 prompt tokens waiting") as refused:
            submit_as(pool, b"A", 10, gate)
        assert "share of 1000" in str(refused.value) and refused.value.retry_after_s == 1
        other, _ = submit_as(pool, b"B", 900, gate)  # another key's share is its own
        pool.settle(first_cost)  # A's first prompt is prefilled: its tokens leave
        pool.settle(first_cost)  # (twice is once)
        second, _ = submit_as(pool, b"A", 600, gate)
        with pytest.raises(Overloaded, match="600 prompt tokens waiting"):
            submit_as(pool, b"A", 500, gate)
        assert pool.tokens == {b"A": 600, b"B": 900}
    finally:
        gate.set()
    for f in (first, other, second):
        f.result(HANG_S)
    wait_for(lambda: not pool.tokens, "every charge settled")  # settled as each ended
    pool.shutdown()


# --- end to end: the pipeline is not wedged by clients that left ----------------

N_ABANDONED = 6  # tenant A's concurrent prompts whose clients give up
GIVE_UP_S = 0.5  # when A's clients leave: far under one prefill of the slow set


def a_prompt(i: int) -> str:
    """A's prompts, each its own from the first token (no prefix-cache hit)."""
    return f"{i} {PROMPT} {PROMPT}"


@pytest.mark.slow
def test_clients_that_left_do_not_wedge_the_pipeline(agent_pair: PairFactory) -> None:
    """A's N_ABANDONED long prompts queue at the slow set's prefill agent (each >=
    3 x SLOW_LAYER_S of forward), and their clients leave (`cancel`, what the
    gateway sets when an HTTP client hangs up). B, right after, is served on the
    remote path while that work, had it run, would still be going: the client, the
    decode agent and the prefill agent all dropped it. Prompts go remote by request:
    this slow stand-in would make placement keep them local."""
    agents = agent_pair.set(shared_tiny("gpt_oss"), **SLOW_SET)
    prefill, decode = agents.prefill, agents.decodes[0]
    assert prefill.token is not None
    client = client_over({"tiny": agents}, prefill.token)
    # As long as A's, never a prefix-cache hit: no cheaper-first overtaking in the queue.
    b_req = GenerateRequest(
        prompt=a_prompt(-1), raw=True, max_tokens=4, placement="remote", prefix_cache=False
    )
    t_quiet = time.monotonic()
    quiet = client.router.run("tiny", b_req)
    quiet_s = time.monotonic() - t_quiet
    before = prefill.status()["queue"]
    logged = log_size(decode)

    t0 = time.monotonic()
    leave = threading.Event()
    answers: list[Any] = []

    def a_client(i: int) -> None:
        req = b_req.replace(prompt=a_prompt(i))
        answers.append(client.generate(req, model="tiny", cancel=leave))

    clients = [threading.Thread(target=a_client, args=(i,)) for i in range(N_ABANDONED)]
    for c in clients:
        c.start()
    wait_for(lambda: prefill.status()["queue"]["waiting"] >= N_ABANDONED - 1, "A's queue")
    time.sleep(GIVE_UP_S)
    leave.set()
    for c in clients:
        c.join(HANG_S)
    left_at = time.monotonic()
    assert [a.finish_reason for a in answers] == ["cancelled"] * N_ABANDONED
    served = client.router.run("tiny", b_req)
    b_done = time.monotonic()
    wait_for(lambda: decode.status()["in_flight"] == 0, "the decode agent to hold nothing")
    idle_at = time.monotonic()
    after, status = prefill.status()["queue"], decode.status()
    print(
        f"B quiet {quiet_s:.2f}s; after A's {N_ABANDONED} abandoned prompts "
        f"{b_done - left_at:.2f}s ({b_done - t0:.2f}s after they were sent); decode idle "
        f"{idle_at - t0:.2f}s after; prefill queue {before} -> {after}"
    )
    assert served.metrics.method == "disaggregated" == quiet.metrics.method
    assert served.token_ids == quiet.token_ids
    # Had A's prompts run, B (behind them) could not be done before this: an
    # ordering against the slow engine's sleeps, not a speed bar.
    abandoned_work_s = N_ABANDONED * 3 * SLOW_LAYER_S
    assert b_done < t0 + abandoned_work_s and idle_at < t0 + abandoned_work_s
    assert status["local_prefills"] == 0 and status["batch"] == 0
    assert "prefilling locally" not in log_since(decode, logged)
    # At most the prompt on the device when its client left (and one handed the
    # device as it stopped) started a forward; the rest left the line unstarted.
    started = after["served"] - before["served"] - 1  # B's own
    assert started <= 2 and after["waiting"] == 0
    assert after["dropped_gone"] - before["dropped_gone"] >= N_ABANDONED - 2

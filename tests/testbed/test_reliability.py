"""Reliability on the four-host test bed, each test with figures (docs/reliability.md).

Faults: SIGKILL of an agent mid-prefill and mid-decode, both fast links cut
mid-traffic, 5 % loss + 50 ms delay on a data link and on the client's switch
path, clients that open a KV socket and say nothing, clients gone mid-stream;
then no session, socket, thread or memory left behind on any agent over >= 200
requests (read from /proc: the hosts share this machine). Load: 64 concurrent
requests across both pipelines, each equal to the same request run alone, p50/p99
latency. Graceful restart: `disagg restart` with requests in flight loses none.

The tests run in order on one fleet this module deploys and starts, and stops at
the end. Requests go out from the ops namespace: a pool of threads that joined it
(setns is per thread), so the test's own thread injects faults while they run.
Each test prints its figures (run with -s); docs/reliability.md records them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from disagg.api import Completion
from disagg.errors import DisaggError, UsageError
from disagg.frontends.batch import BatchItem, run_batch
from disagg.serving import wireclient as wire
from disagg.serving.checkedrequest import build_request
from disagg_agents.runtime.gate import HANDSHAKE_TIMEOUT_S
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest
from tests.testbed.bed import BY_NAME, TestBed
from tests.testbed.conftest import FleetCli
from tests.testbed.rig import (
    DECODE,
    FIGURES,
    LONG_PROMPT,
    MAX_TOKENS,
    MODELS,
    PREFILL,
    PROMPTS,
    REQUEST_TIMEOUT_S,
    Ledger,
    Rig,
    agent_log,
    agent_pid,
    dropped_after,
    impaired,
    join_netns,
    listen_overflows,
    path,
    pct,
    say,
    silent_socket,
    socket_count,
    traffic,
    usage,
    wait_until,
)

pytestmark = pytest.mark.testbed
ORDERED = True  # one story: kills, then the leak window over the faults, then a restart


# Resident growth over the leak window an agent may show. A prefill agent's grew 47-68 MB
# (torch's and malloc's high water after the window's concurrent bursts; 64 MB was the
# bound, and one run in two alone went past it); what it is sized to catch, each
# request's K/V kept (~1 MB per SmolLM2 prompt here, ~100 requests per agent), is more.
LEAK_BOUND_KB = 96 * 1024

# A cut shorter than the 4 s it was: the stream still stalls (TCP retransmits) and
# completes once the link is back, and the retransmit backoff after a longer cut made
# the request wait ~4 s more once the link was up.
MID_STREAM_CUT_S = 2.0
DURING_CUT = 2  # requests while the link is down between streams: each takes the switch

DRAIN_TOKENS = 48  # ~10 s of decode here: still running when restart's SIGTERM lands


def remote_req(prompt: str) -> GenerateRequest:
    """The reliability rig's usual request: MAX_TOKENS, prefilled remotely."""
    return build_request(prompt=prompt, max_tokens=MAX_TOKENS, placement="remote")


@pytest.fixture(scope="module")
def rig(testbed: TestBed, inventory: Path, fleet_cli: FleetCli) -> Iterator[Rig]:
    """Deploy and start the fleet; the greedy reference of every prompt, each run alone on
    its pipeline; at the end, stop the fleet and check every agent stopped."""
    t0 = time.monotonic()
    dep = fleet_cli("deploy", "-i", str(inventory), "--json", timeout=400)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    token = (testbed.ops_dir / "cluster.token").read_bytes().strip()
    pool = ThreadPoolExecutor(80, "ops", initializer=join_netns, initargs=("ops",))
    rig = Rig(testbed, inventory, fleet_cli, pool, token)
    try:
        started = fleet_cli("start", "-i", str(inventory), timeout=400)
        assert started.returncode == 0, started.stdout + started.stderr
        assert set(rig.fleet_status().values()) == {"healthy"}
        rig.client = rig.in_ops(rig.make_client)
        up = time.monotonic() - t0

        def alone(model: str) -> dict[tuple[str, str], Completion]:
            return {(model, p): rig.gen(model, p) for p in (*PROMPTS, LONG_PROMPT)}

        t1 = time.monotonic()
        for fut in [rig.submit(alone, m) for m in MODELS]:  # one request at a time per pipeline
            rig.refs.update(fut.result(600))
        for (model, prompt), c in rig.refs.items():
            assert c.metrics.method == "disaggregated" and c.token_ids, (model, prompt, c)
        assert "Paris" in rig.refs[(MODELS[0], PROMPTS[0])].text
        say(
            "fleet",
            {
                "deploy_and_start_s": round(up, 1),
                "references_s": round(time.monotonic() - t1, 1),
                "references": {f"{m} | {p[:30]}": c.text for (m, p), c in rig.refs.items()},
                "long_prompt_tokens": rig.refs[(MODELS[0], LONG_PROMPT)].metrics.prompt_tokens,
                "long_prompt_prefill_s": rig.refs[(MODELS[0], LONG_PROMPT)].metrics.prefill_time,
            },
        )
        yield rig
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        t_stop = time.monotonic()
        stopped = fleet_cli("stop", "-i", str(inventory), timeout=300)
        FIGURES["stop_s"] = round(time.monotonic() - t_stop, 1)
        states = rig.fleet_status()
        sys.stdout.write(f"\nSUMMARY {json.dumps(FIGURES, sort_keys=True, default=str)}\n")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert set(states.values()) == {"stopped"}, states


@pytest.mark.fault
def test_sigkill_prefill_mid_prefill(rig: Rig) -> None:
    """The qwen pipeline's prefill agent dies while it computes a ~150-token prompt: the
    decode agent prefills locally and the request still ends in the reference text; the
    other pipeline serves on meanwhile; `disagg start HOST` brings the agent back."""
    model, host = MODELS[0], PREFILL[MODELS[0]]
    other: list[Any] = []
    side = rig.submit(traffic, rig, MODELS[1], 3, other)
    pid = agent_pid(host)
    t0 = time.monotonic()
    fut = rig.submit(rig.gen, model, LONG_PROMPT)
    rig.in_ops(wait_until, lambda: rig.status(host)["in_flight"] > 0, 60, "the prefill to start")
    time.sleep(0.3)  # about half way through its ~0.7 s
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic() - t0
    c = fut.result(REQUEST_TIMEOUT_S)
    took = time.monotonic() - t0
    assert c.metrics.method == "local-fallback", c.metrics
    assert "failed" in (c.metrics.fallback_reason or ""), c.metrics  # the stream broke mid-way
    rig.check(model, LONG_PROMPT, c)
    side.result(REQUEST_TIMEOUT_S)
    assert [o for o, *_ in other] == ["ok"] * 3, other
    restart_s = rig.start_host(host)
    rig.serves_both()
    say(
        "sigkill prefill mid-prefill",
        {
            "killed_after_s": round(killed_at, 2),
            "request_s": round(took, 1),
            "method": c.metrics.method,
            "fallback_reason": c.metrics.fallback_reason,
            "text_equal_reference": True,
            "other_pipeline_ok": len(other),
            "restart_s": round(restart_s, 1),
        },
    )


@pytest.mark.fault
def test_sigkill_decode_mid_decode(rig: Rig) -> None:
    """The gpt-oss pipeline's decode agent dies while it streams tokens: the client gets a
    clear error at once, not a hang or a truncated text passed off as an answer; the other
    pipeline serves on; `disagg start HOST` brings the agent back."""
    model, host = MODELS[1], DECODE[MODELS[1]]
    other: list[Any] = []
    side = rig.submit(traffic, rig, MODELS[0], 3, other)
    pid = agent_pid(host)
    assert rig.client is not None
    client = rig.client

    def doomed() -> tuple[int, float, str]:
        chunks = client.generate(
            model=model,
            prompt=PROMPTS[0],
            max_tokens=64,
            ignore_eos=True,
            placement="remote",
            stream=True,
        )
        assert not isinstance(chunks, Completion)
        got = 0
        t_kill = 0.0
        try:
            for _chunk in chunks:
                got += 1
                if got == 2:  # streaming: kill it
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.monotonic()
            raise AssertionError("the stream ended without an error")
        except DisaggError as e:
            return got, time.monotonic() - t_kill, str(e)

    got, err_after, message = rig.in_ops(doomed, timeout=REQUEST_TIMEOUT_S)
    assert err_after < 10, err_after
    assert "decode" in message, message
    side.result(REQUEST_TIMEOUT_S)
    assert [o for o, *_ in other] == ["ok"] * 3, other
    restart_s = rig.start_host(host)
    rig.serves_both()
    say(
        "sigkill decode mid-decode",
        {
            "chunks_before_kill": got,
            "error_after_s": round(err_after, 2),
            "error": message,
            "other_pipeline_ok": len(other),
            "restart_s": round(restart_s, 1),
        },
    )


# ---- faults on the network and from clients; the leak window opens here -------------------


@pytest.fixture(scope="module")
def window(rig: Rig) -> Ledger:
    """Baseline of every agent (warm, idle) before the faults the leak check covers."""
    led = rig.ledger
    rig.serves_both()  # warm after the kills' restarts
    led.pids = {h: agent_pid(h) for h in BY_NAME}
    led.baseline = {
        h: {**usage(pid), "sockets": socket_count(pid), "cached_kb": rig.in_ops(rig.cached_kb, h)}
        for h, pid in led.pids.items()
    }
    return led


def cut_link_mid_traffic(rig: Rig, model: str) -> dict[str, Any]:
    """Cut the pipeline's fast link twice (in an ops thread): MID_STREAM_CUT_S in the
    middle of a KV stream, then between streams for as long as the requests during the
    cut take, while requests go on one after another."""
    assert rig.client is not None
    link, host = BY_NAME[PREFILL[model]].link, PREFILL[model]
    # In the middle of a KV stream: the stream waits the cut out (TCP retransmits).
    fut = rig.submit(rig.gen, model, LONG_PROMPT)
    wait_until(lambda: rig.status(host)["in_flight"] > 0, 60, "the prefill to start")
    time.sleep(0.2)
    rig.bed.link(link, up=False)
    time.sleep(MID_STREAM_CUT_S)
    rig.bed.link(link, up=True)
    t0 = time.monotonic()
    mid = fut.result(REQUEST_TIMEOUT_S)
    mid_after_up = time.monotonic() - t0
    rig.check(model, LONG_PROMPT, mid)
    # Between streams: cut as a request decodes; the next ones take the switch.
    chunks = rig.client.generate(
        model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, placement="remote", stream=True
    )
    assert not isinstance(chunks, Completion)
    # The link comes back once the requests during the cut are done (it was a 6 s
    # timer: one after the other they took about that, and then a late one could take
    # the link back, so only the first was asserted; now each of them is).
    cut_at = 0.0
    during: list[Any] = []
    try:
        for chunk in chunks:
            if not cut_at and not chunk.done:
                rig.bed.link(link, up=False)
                cut_at = time.monotonic()
            if chunk.completion:
                rig.check(model, PROMPTS[0], chunk.completion)
        traffic(rig, model, DURING_CUT, during)
    finally:
        rig.bed.link(link, up=True)
    down_s = time.monotonic() - cut_at
    after: list[Any] = []
    traffic(rig, model, 1, after)
    assert [o for o, *_ in during + after] == ["ok"] * (DURING_CUT + 1), during + after
    via = [path(met) for _, _, met in during]
    assert via == ["switch"] * DURING_CUT, via
    assert path(after[0][2]) == "fast link", after
    return {
        "mid_kv_stream": {
            "request_s": round((mid.metrics.total_time or 0), 1),
            "done_after_link_up_s": round(mid_after_up, 1),
            "method": mid.metrics.method,
            "prefill_via": path(mid.metrics),
        },
        "between_streams": {
            "link_down_s": round(down_s, 1),
            "prefill_via_during_cut": via,
            "request_s_during_cut": [round(t, 1) for _, t, _ in during],
            "prefill_via_after": path(after[0][2]),
        },
        "requests": 3 + DURING_CUT,
        "lost": 0,
    }


@pytest.mark.fault
def test_fast_links_down_mid_traffic(rig: Rig, window: Ledger) -> None:
    """Each pipeline's fast data link goes down twice while it serves: 2 s in the middle of
    a KV stream (the stream stalls and completes when the link is back), and between KV
    streams (the next requests take the switch, then the link again). Every request
    ends in the reference text."""
    futs = {m: rig.submit(cut_link_mid_traffic, rig, m) for m in MODELS}
    figures = {m: f.result(REQUEST_TIMEOUT_S * 4) for m, f in futs.items()}
    window.add("link down", sum(f["requests"] for f in figures.values()))
    say("fast links down mid-traffic", figures)


@pytest.mark.fault
def test_loss_and_delay(rig: Rig, window: Ledger) -> None:
    """5 % packet loss and 50 ms delay each way on the gpt-oss pipeline's data link and on
    the client's switch path to its decode agent: requests still end in the reference
    text (disaggregated, or prefilled locally if the KV stream outlasts its timeout)."""
    model, n = MODELS[1], 4
    done: list[Any] = []
    with impaired(50, 5.0) as info:
        t0 = time.monotonic()
        # At once, each its own prompt: the time goes to the lossy paths' retransmits,
        # which one after another added up (the decode agent batches the requests).
        futs = [rig.submit(traffic, rig, model, 1, done, (PROMPTS[i],)) for i in range(n)]
        for f in futs:
            f.result(REQUEST_TIMEOUT_S * n)
        wall = time.monotonic() - t0
    window.add("lossy", n)
    assert [o for o, *_ in done] == ["ok"] * n, done
    # The precondition: packets were really lost on both paths (netem's or the relay's count).
    assert info["data_link_dropped"] > 0 and info["switch_dropped"] > 0, info
    clean: list[Any] = []
    rig.in_ops(traffic, rig, model, 1, clean)  # and fine again afterwards
    assert clean[0][0] == "ok", clean
    window.add("lossy", 1)
    say(
        "5% loss + 50 ms delay",
        {
            **info,
            "requests": n,
            "lost": 0,
            "wall_s": round(wall, 1),
            "per_request_s": [round(t, 2) for _, t, _ in done],
            "methods": dict(Counter(met.method for _, _, met in done)),
            "kv_fetch_s": [round(met.kv_fetch_time or 0, 2) for _, _, met in done],
            "after_s": round(clean[0][1], 2),
        },
    )


@pytest.mark.fault
def test_silent_kv_clients(rig: Rig, window: Ledger) -> None:
    """Five connections to each agent's data port that never speak: real requests are
    served meanwhile, and each silent one is dropped after the handshake timeout."""
    socks = [rig.in_ops(silent_socket, h) for h in BY_NAME for _ in range(5)]
    t0 = time.monotonic()
    rig.serves_both()
    served_s = time.monotonic() - t0
    waits = [rig.submit(dropped_after, s) for s in socks]
    dropped = [w.result(HANDSHAKE_TIMEOUT_S + 30) for w in waits]
    assert max(dropped) < HANDSHAKE_TIMEOUT_S + 10, dropped
    window.add("silent", len(socks))
    window.add("ok", 2)
    say(
        "silent KV clients",
        {
            "silent_connections": len(socks),
            "served_meanwhile_s": round(served_s, 2),
            "dropped_after_s_max": round(max(dropped), 1),
            "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        },
    )


def gone_mid_stream(rig: Rig, model: str) -> float:
    """Start a 200-token stream, read two tokens, hang up; seconds until the decode agent
    is idle again."""
    assert rig.client is not None
    pipe = rig.client.router.pipeline(model)
    ep = pipe.decode[0]
    req = build_request(
        prompt=PROMPTS[1],
        max_tokens=200,
        ignore_eos=True,
        placement="remote",
        prefill=rig.client.router.prefill_target(pipe),
    )
    events = wire.stream(ep.host, ep.port, req, token=rig.token)
    for _ in range(2):
        event = next(events)
        assert isinstance(event, TokenEvent), event
    events.close()
    t0 = time.monotonic()
    wait_until(lambda: rig.busy(DECODE[model]) == 0, 30, "the decode agent to stop", 0.05)
    return time.monotonic() - t0


@pytest.mark.fault
def test_clients_gone_mid_stream(rig: Rig, window: Ledger) -> None:
    """Clients hang up two tokens into 200-token streams: the decode agent stops within a
    second or so, and the next request is served with the reference text."""
    n = 4
    idle: dict[str, list[float]] = {m: [] for m in MODELS}

    def run(model: str) -> None:
        for _ in range(n):
            idle[model].append(gone_mid_stream(rig, model))

    for f in [rig.submit(run, m) for m in MODELS]:
        f.result(REQUEST_TIMEOUT_S)
    window.add("gone mid-stream", 2 * n)
    for m in MODELS:
        assert "client went away" in agent_log(DECODE[m])
    rig.serves_both()
    window.add("ok", 2)
    worst = max(max(v) for v in idle.values())
    assert worst < 5, idle
    say("clients gone mid-stream", {"clients": 2 * n, "decode_idle_after_s_max": round(worst, 2)})


# ---- load ---------------------------------------------------------------------------------


@pytest.mark.load
def test_64_concurrent_requests(rig: Rig, window: Ledger) -> None:
    """64 requests at once, 32 per pipeline, four distinct prompts: all complete within a
    bound, each token-identical to the same request run alone; p50/p99 latency."""
    assert rig.client is not None
    reqs = [
        BatchItem(i, MODELS[i % 2], remote_req(PROMPTS[(i // 2) % len(PROMPTS)])) for i in range(64)
    ]
    overflows = listen_overflows()
    batch = rig.in_ops(run_batch, rig.client, reqs, None, 64, timeout=600)
    overflows = {h: n - overflows[h] for h, n in listen_overflows().items()}
    window.add("load", len(reqs))
    errors = [(r["id"], round(r["time"], 1), r["error"]) for r in batch.results if r.get("error")]
    assert batch.failed == 0, (overflows, errors)
    same = total = 0
    for req, row in zip(reqs, batch.results, strict=True):
        ref = rig.refs[(str(req.model), str(req.request.prompt))]
        total += len(ref.token_ids)
        same += sum(a == b for a, b in zip(row["token_ids"], ref.token_ids, strict=False))
        assert row["token_ids"] == ref.token_ids and row["text"] == ref.text, (row, ref.text)
        assert row["metrics"]["method"] == "disaggregated", row
    times = [r["time"] for r in batch.results]  # figures: in_ops' 600 s is the hang guard
    say(
        "load: 64 concurrent",
        {
            "requests": len(reqs),
            "completed": len(reqs) - batch.failed,
            "token_agreement": f"{same}/{total}",
            "wall_s": round(batch.wall_time, 1),
            "p50_s": round(pct(times, 50), 2),
            "p99_s": round(pct(times, 99), 2),
            "min_s": round(min(times), 2),
            "mean_s": round(statistics.mean(times), 2),
            "ttft_p50_s": round(pct([r["metrics"]["ttft"] for r in batch.results], 50), 2),
            "max_tokens": MAX_TOKENS,
            "listen_overflows": overflows,
        },
    )


# ---- no leaks -----------------------------------------------------------------------------


def mixed(rig: Rig, kind: str, model: str, silent: list[socket.socket]) -> None:
    """One request of a kind the leak check mixes in (in an ops thread)."""
    assert rig.client is not None
    if kind == "ok":
        out: list[Any] = []
        traffic(rig, model, 1, out)
        assert out[0][0] == "ok", out
    elif kind == "gone":
        gone_mid_stream(rig, model)
    elif kind == "silent":  # checked, and closed, at the end
        silent.append(silent_socket(PREFILL[model] if len(silent) % 2 else DECODE[model]))
    elif kind == "bad":
        ep = rig.client.router.pipeline(model).decode[0]
        with pytest.raises(UsageError):
            wire.generate(ep.host, ep.port, {"prompt": "", "max_tokens": 2}, token=rig.token)
    else:  # the prefill target is gone: the decode agent prefills locally, same text
        gone = {"hosts": [BY_NAME[PREFILL[model]].link_addr], "port": 1, "timeout": 5}
        req = build_request(
            prompt=PROMPTS[2], max_tokens=MAX_TOKENS, placement="remote", prefill=gone
        )
        res = rig.client.router.run(model, req)
        assert res.metrics.method == "local-fallback", res.metrics
        ref = rig.refs[(model, PROMPTS[2])]
        assert res.token_ids == ref.token_ids and res.text == ref.text, (res, ref)


@pytest.mark.fault
def test_no_leaks_over_200_requests(rig: Rig, window: Ledger) -> None:
    """Everything since the window opened, topped up with a mix (served, gone mid-stream,
    silent, bad, prefill target gone) to >= 200 requests: the agents are the same
    processes, idle, and hold no more fds, sockets or threads than before, nor much
    more memory."""
    plan = ["ok"] * 8 + ["gone"] * 6 + ["silent"] * 6 + ["bad"] * 6 + ["fallback"] * 2
    left = max(0, 200 - window.total)
    per_model = -(-left // 2)
    kinds = [plan[i % len(plan)] for i in range(per_model)]

    silent: list[socket.socket] = []

    def run(model: str) -> Counter[str]:
        # The served ones at once (the decode agent batches them; one after another
        # they were half the check's time), then the rest in turn: a client gone
        # mid-stream waits for its decode agent to be idle.
        served: list[Any] = []
        n_ok = kinds.count("ok")
        prompts = [(PROMPTS[i % len(PROMPTS)],) for i in range(n_ok)]
        for f in [rig.submit(traffic, rig, model, 1, served, p) for p in prompts]:
            f.result(REQUEST_TIMEOUT_S)
        assert [o for o, *_ in served] == ["ok"] * n_ok, served
        done: Counter[str] = Counter(ok=n_ok)
        for kind in kinds:
            if kind != "ok":
                mixed(rig, kind, model, silent)
                done[kind] += 1
        return done

    t0 = time.monotonic()
    for f in [rig.submit(run, m) for m in MODELS]:
        for kind, count in f.result(600).items():
            window.add(f"top-up {kind}", count)
    waits = [rig.submit(dropped_after, s) for s in silent]
    assert max(w.result(HANDSHAKE_TIMEOUT_S + 30) for w in waits) < HANDSHAKE_TIMEOUT_S + 10
    topup_s = time.monotonic() - t0
    assert window.total >= 200, window.counts

    pids = {h: agent_pid(h) for h in BY_NAME}
    assert pids == window.pids, (window.pids, pids)  # nobody crashed or restarted
    rig.in_ops(wait_until, lambda: all(rig.busy(h) == 0 for h in BY_NAME), 60, "idle agents", 0.1)

    def now() -> dict[str, dict[str, int]]:
        return {h: {**usage(pid), "sockets": socket_count(pid)} for h, pid in pids.items()}

    base = window.baseline
    deadline = time.monotonic() + 30
    after = now()
    while time.monotonic() < deadline and not all(
        after[h][k] <= base[h][k] for h in base for k in ("fds", "threads", "sockets")
    ):
        time.sleep(0.25)
        after = now()
    report = {h: {k: f"{base[h][k]} -> {after[h][k]}" for k in after[h]} for h in sorted(base)}
    # Resident growth less what the prefix cache took in (prompt K/V it keeps on purpose,
    # within its budget), read once per agent.
    grown_kb = {
        h: after[h]["rss_kb"]
        - base[h]["rss_kb"]
        - max(0, rig.in_ops(rig.cached_kb, h) - base[h]["cached_kb"])
        for h in sorted(base)
    }
    say(
        "no leaks",
        {
            "requests": window.total,
            "by_kind": dict(window.counts),
            "top_up_s": round(topup_s, 1),
            "agents": report,
            "rss_growth_kb_max": max(after[h]["rss_kb"] - base[h]["rss_kb"] for h in base),
            "less_prefix_cache_kb": grown_kb,
        },
    )
    for h in base:
        for k in ("fds", "threads", "sockets"):
            assert after[h][k] <= base[h][k], (h, k, report[h])
        assert grown_kb[h] < LEAK_BOUND_KB, (h, report[h], grown_kb[h])
    for h in BY_NAME:
        st = rig.in_ops(rig.status, h)
        assert st["in_flight"] == 0 and not st.get("queued"), (h, st)


# ---- graceful restart ---------------------------------------------------------------------


@pytest.mark.fault
def test_restart_drains_requests_in_flight(rig: Rig) -> None:
    """`disagg restart` while each pipeline has four requests (one long, all accepted):
    SIGTERM, the agents finish all of them, exit, start again; none is lost, each in the
    reference text; new requests are served after."""
    assert rig.client is not None
    # The first request of each pipeline runs DRAIN_TOKENS: six-token ones alone could all
    # finish before `disagg restart` reaches the agent over ssh (seen on a loaded box),
    # and then the drain would prove nothing. Its reference: the same request, before.
    long = {"max_tokens": DRAIN_TOKENS, "ignore_eos": True}
    pending = {m: rig.submit(rig.gen, m, PROMPTS[0], **long) for m in MODELS}
    refs = {(m, PROMPTS[0], DRAIN_TOKENS): f.result(REQUEST_TIMEOUT_S) for m, f in pending.items()}
    before = {h: agent_pid(h) for h in BY_NAME}
    reqs = [
        BatchItem(
            i,
            MODELS[i % 2],
            build_request(prompt=PROMPTS[0], placement="remote", **long)
            if i < 2
            else remote_req(PROMPTS[(i // 2) % len(PROMPTS)]),
        )
        for i in range(8)
    ]
    finished: Counter[str] = Counter()
    logs = {h: len(agent_log(h)) for h in BY_NAME}
    t0 = time.monotonic()
    fut = rig.submit(
        run_batch, rig.client, reqs, None, 8, on_done=lambda r: finished.update([r["model"]])
    )
    # Every request accepted by its decode agent (running, queued or done), none in a backlog.
    rig.in_ops(
        wait_until,
        lambda: all(rig.busy(DECODE[m]) + finished[m] == 4 for m in MODELS),
        60,
        "all eight requests accepted",
        0.05,
    )
    in_flight = {m: rig.in_ops(rig.status, DECODE[m])["in_flight"] for m in MODELS}
    assert all(n >= 1 for n in in_flight.values()), in_flight  # running as restart begins
    t_restart = time.monotonic()
    proc = rig.cli("restart", "-i", str(rig.inventory), timeout=400)
    restart_s = time.monotonic() - t_restart
    assert proc.returncode == 0, proc.stdout + proc.stderr
    batch = fut.result(REQUEST_TIMEOUT_S)
    assert batch.failed == 0, [r for r in batch.results if r.get("error")]
    for req, row in zip(reqs, batch.results, strict=True):
        key = (str(req.model), str(req.request.prompt))
        ref = refs.get((*key, req.request.max_tokens)) or rig.refs[key]
        assert row["token_ids"] == ref.token_ids and row["text"] == ref.text, (row, ref.text)
    assert all(len(r["token_ids"]) == DRAIN_TOKENS for r in batch.results[:2]), batch.results[:2]
    done_by = max(r["time"] for r in batch.results) - (t_restart - t0)
    after = {h: agent_pid(h) for h in BY_NAME}
    assert all(after[h] != before[h] for h in BY_NAME), (before, after)
    for h in BY_NAME:
        log = agent_log(h)[logs[h] :]
        assert "drained and stopped" in log, (h, log[-2000:])
        if h in DECODE.values():  # the agent itself counted requests under way at SIGTERM
            found = re.search(r"decode draining: no new connections, waiting for (\d+)", log)
            assert found and int(found[1]) >= 1, (h, log[-2000:])
        assert "stopped with" not in log, h  # no request cut off at the drain timeout
    assert set(rig.fleet_status().values()) == {"healthy"}
    rig.serves_both()
    say(
        "graceful restart",
        {
            "requests_in_flight": len(reqs),
            "running_at_restart": in_flight,
            "lost": batch.failed,
            "methods": dict(Counter(r["metrics"]["method"] for r in batch.results)),
            "last_done_after_restart_began_s": round(done_by, 1),
            "restart_s": round(restart_s, 1),
            "served_after": 2,
        },
    )

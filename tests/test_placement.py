"""Adaptive placement: prefill on the decode host when the measured rates say it is faster."""

from __future__ import annotations

import re

import pytest

from disagg_agents.decode.placement import Placement
from tests.conftest import PairFactory, ask
from tests.test_auth import Recorder
from tests.tinymodels import shared_tiny

FETCH = {
    "prefill_time": 0.5,
    "kv_fetch_time": 0.52,
    "kv_bytes": 30_000_000,
    "kv_transfer_time": 0.5,
}


def test_no_measurement_means_remote() -> None:
    p = Placement()
    assert p.choose("a:1", 100) == ("remote", "no measurement of the prefill agent yet")
    p.observe_remote("a:1", 1000, 30, FETCH)
    assert p.choose("a:1", 100) == ("remote", "no measurement of local prefill yet")


def test_fast_remote_wins_for_long_prompts_and_slow_decode_host() -> None:
    p = Placement()
    p.observe_remote("a:1", 1000, 30, FETCH)  # 2,000 tok/s, 20 ms handshake
    p.observe_local(1000, 10.0)  # 100 tok/s here
    where, why = p.choose("a:1", 1000)
    assert where == "remote" and "est. remote" in why and "local prefill 100 tok/s" in why


def test_tiny_prompts_stay_local_when_local_is_measured_faster() -> None:
    p = Placement()
    p.observe_remote("a:1", 1000, 30, FETCH)
    p.observe_step(0.002)  # no local prefill measured: bound by decode steps
    assert p.choose("a:1", 3)[0] == "local"  # 6 ms < 20 ms handshake
    assert p.choose("a:1", 2000)[0] == "remote"  # 4 s of steps > 1 s remote
    assert p.choose("b:2", 3)[0] == "remote"  # another prefill agent: not measured


def test_a_local_rate_stands_only_near_the_lengths_it_was_measured_at() -> None:
    """Attention grows with the square of the length: a local rate from 1,000-token
    prompts says nothing of 45,000 (mlx on this CPU: 150 s, torch 8 s)."""
    from disagg_agents.decode.placement import EXTRAPOLATE

    p = Placement()
    p.observe_remote("a:1", 1000, 30, {**FETCH, "prefill_time": 2.0, "kv_fetch_time": 2.02})
    p.observe_local(1000, 1.0)  # 1,000 tok/s here, twice the prefill agent's 500
    assert p.choose("a:1", EXTRAPOLATE * 1000)[0] == "local"
    where, why = p.choose("a:1", EXTRAPOLATE * 1000 + 1)
    assert where == "remote" and "longest prompt prefilled here (1000)" in why, why
    p.observe_local(45_000, 150.0)  # a forced local prefill that long: measured now
    assert p.local_longest == 45_000


def test_an_old_remote_estimate_is_measured_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg_agents.decode import placement

    now = [1000.0]
    monkeypatch.setattr(placement.time, "monotonic", lambda: now[0])
    p = Placement()
    slow = {**FETCH, "prefill_time": 50.0, "kv_fetch_time": 50.02}  # a bad minute: 20 tok/s
    p.observe_remote("a:1", 1000, 30, slow)
    p.observe_local(1000, 10.0)
    assert p.choose("a:1", 500)[0] == "local"
    now[0] += placement.REMEASURE_S + 1
    where, why = p.choose("a:1", 500)
    assert where == "remote" and "measuring the prefill agent again (61 s old)" in why
    assert p.choose("a:1", 500)[0] == "local"  # one request re-measures, not every one


def test_agents_choose_from_their_own_measurements(agent_pair: PairFactory) -> None:
    prefill, decode = agent_pair(shared_tiny("qwen3_moe"))
    # The shared decode agent has measured this prefill agent before: a relay in front
    # of it is a prefill address it has never seen (its estimates are per address).
    relay = Recorder((prefill.host, prefill.port))
    try:
        target = {"host": "127.0.0.1", "port": relay.port}
        base = {"prompt": "hello there", "raw": True, "max_tokens": 4, "prefill": target}
        first = ask(decode, base).metrics
        assert first.method == "disaggregated"
        assert first.placement_reason == "no measurement of the prefill agent yet"
        forced = ask(decode, {**base, "placement": "local"}).metrics
        assert forced.method == "local" and forced.kv_bytes == 0
        # Both sides are measured now. On a tiny model the two estimates are a few ms
        # apart and which wins depends on this machine's load; what must hold is that
        # the agent chose by its own estimates, and did what it chose.
        pattern = r"est\. remote ([\d.]+) ms .* vs local ([\d.]+) ms"
        for _ in range(3):
            auto = ask(decode, base).metrics
            found = re.search(pattern, auto.placement_reason or "")
            assert found, auto.placement_reason
            remote_ms, local_ms = float(found[1]), float(found[2])
            if local_ms != remote_ms:  # equal once rounded to 0.1 ms: either is right
                assert auto.placement == ("local" if local_ms < remote_ms else "remote")
            if auto.placement == "local":
                assert auto.method == "local" and auto.kv_bytes == 0
            else:
                assert auto.method == "disaggregated" and (auto.kv_bytes or 0) > 0
    finally:
        relay.close()

"""The prefix cache's disk tier (disagg_agents.prefix.disk): block files that are
atomic, checksummed and keyed by model and tenant, held to a budget; and a real
decode agent restarted over its directory serving a 2k-token prompt from it."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from disagg.serving.localagents import AgentProc, restart_agent
from disagg_agents.prefix.blockfile import UNSALTED, block_name
from disagg_agents.prefix.disk import DiskTier, fingerprint_digest
from disagg_agents.prefix.store import Block, block_keys
from disagg_agents.wire.status import AgentStatus
from tests.conftest import PairFactory, ask, remote_request, start_serve
from tests.tinymodels import CORPUS, shared_tiny

FP = fingerprint_digest({"architecture": "llama", "layers": 2})
SECRET = b"t" * 64  # a cluster token


def block(seed: int, layers: int = 2) -> Block:
    rng = np.random.default_rng(seed)
    kv = [(rng.standard_normal((2, 16, 8), np.float32),) * 2 for _ in range(layers)]
    pairs = tuple(None if i == 1 else (k[0], k[0] + 1) for i, k in enumerate(kv))
    return Block(pairs, sum(p[0].nbytes * 2 for p in pairs if p is not None))


def same(a: Block, b: Block) -> bool:
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and all(np.array_equal(u, v) for u, v in zip(x, y, strict=True))
        )
        for x, y in zip(a.layers, b.layers, strict=True)
    )


def test_blocks_round_trip_and_survive_a_restart(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, FP, SECRET)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, k in enumerate(keys):
        disk.put(k, block(i))
    disk.close()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # renamed into place
    again = DiskTier(tmp_path, 1 << 20, FP, SECRET)  # a restarted agent's, same token
    for i, k in enumerate(keys):
        got = again.get(k)
        assert got is not None and same(got, block(i))
    assert again.get(b"\x09" * 16) is None
    again.close()
    other = DiskTier(tmp_path, 1 << 20, fingerprint_digest({"other": 1}), SECRET)
    assert other.get(keys[0]) is None


def test_a_flipped_byte_is_a_miss_and_its_file_goes(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, FP)
    key = b"k" * 16
    disk.put(key, block(0))
    disk.flush()
    path = tmp_path / disk.name(key)
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # one bit of K/V
    path.write_bytes(bytes(data))
    assert disk.get(key) is None
    assert disk.snapshot()["corrupt"] == 1 and not path.exists()


def test_a_foreign_block_under_the_right_name_is_dropped(tmp_path: Path) -> None:
    """Another model's file copied under this model's name: its header says whose."""
    ours = DiskTier(tmp_path / "a", 1 << 20, FP, SECRET)
    theirs = DiskTier(tmp_path / "b", 1 << 20, "x", SECRET)
    key = b"k" * 16
    theirs.put(key, block(0))
    theirs.flush()
    ours.close()
    (tmp_path / "a" / ours.name(key)).write_bytes((tmp_path / "b" / theirs.name(key)).read_bytes())
    ours = DiskTier(tmp_path / "a", 1 << 20, FP, SECRET)  # finds the file at start
    assert ours.get(key) is None and ours.snapshot()["corrupt"] == 1


def file_size(tmp_path: Path) -> int:
    """One block file's size, as the tier writes it."""
    probe = DiskTier(tmp_path / "probe", 1 << 20, FP, SECRET)
    probe.put(b"p" * 16, block(0))
    probe.close()
    return (tmp_path / "probe" / probe.name(b"p" * 16)).stat().st_size


def test_the_budget_evicts_least_recently_used_and_zero_empties(tmp_path: Path) -> None:
    one = file_size(tmp_path)
    root = tmp_path / "d"
    disk = DiskTier(root, int(2.5 * one), FP)
    keys = [bytes([i]) * 16 for i in range(4)]
    for i, k in enumerate(keys[:2]):
        disk.put(k, block(i))
    disk.flush()
    assert disk.get(keys[0]) is not None  # now the most recently used
    disk.put(keys[2], block(2))
    disk.flush()
    s = disk.snapshot()
    assert s["bytes"] <= s["max_bytes"] and s["evictions"] >= 1
    assert disk.get(keys[1]) is None and disk.get(keys[0]) is not None
    disk.set_budget(0)
    assert disk.snapshot()["blocks"] == 0 and not list(root.glob("*.kv"))
    disk.put(keys[3], block(3))  # off: nothing written, nothing fails
    disk.flush()
    assert not list(root.glob("*.kv"))


# ---- a real decode agent, restarted -------------------------------------------------


def long_prompt(n_words: int = 1560) -> str:
    words = " ".join(CORPUS).split()
    return " ".join(words[i % len(words)] for i in range(n_words))


def with_disk(template: AgentProc, root: Path, mb: float = 64) -> AgentProc:
    """A decode agent started as `template` was, plus the disk tier in `root`: what a
    restart of an agent run with --prefix-disk gives."""
    extra = [*template.spawn.get("extra_args", ()), "--prefix-disk", str(root)]
    extra += ["--prefix-disk-mb", str(mb)]
    return restart_agent(
        dataclasses.replace(template, spawn={**template.spawn, "extra_args": extra})
    )


def settled(agent: AgentProc) -> dict[str, Any]:
    """The agent's disk tier once its queued writes are done (they are async)."""
    deadline = time.monotonic() + 60
    while True:
        s = agent.status()["prefix_disk"]
        if not s["queued_writes"] or time.monotonic() > deadline:
            time.sleep(0.2)  # the last one dequeued may still be writing
            return dict(agent.status()["prefix_disk"])
        time.sleep(0.1)


@pytest.mark.slow
def test_a_restarted_decode_agent_serves_a_2k_prompt_from_disk(
    agent_pair: PairFactory, tmp_path: Path
) -> None:
    prefill, pooled = agent_pair(shared_tiny("llama"))
    root = tmp_path / "prefix-disk"
    req = remote_request(prefill, long_prompt(), max_tokens=16, return_prompt_ids=True)
    first = with_disk(pooled, root)
    try:
        cold = ask(first, {**req, "prefix_cache": False})  # the answer without any cache
        ids = cold.prompt_ids
        assert ids is not None and len(ids) >= 2000
        stored = ask(first, req)
        assert stored.token_ids == cold.token_ids
        blocks = (len(ids) - 1) // 16
        assert settled(first)["blocks"] >= blocks
    finally:
        first.stop()

    second = with_disk(pooled, root)
    try:
        warm = ask(second, req)
        m = warm.metrics
        assert (m.disk_cached_tokens or 0) >= 0.9 * len(ids) and (m.cached_tokens or 0) >= (
            m.disk_cached_tokens or 0
        )
        assert warm.token_ids == cold.token_ids
        status = second.status()
        typed = AgentStatus.from_json(status)  # as `disagg status` and the web view read it
        assert typed.mistyped == () and typed.prefix_disk is not None
        assert typed.prefix_disk.cached_tokens == m.disk_cached_tokens
        assert typed.prefix_disk.hits and typed.prefix_disk.bytes
        fp = fingerprint_digest(status["fingerprint"])
    finally:
        second.stop()

    # One flipped byte in block 10's file: that block is a miss, the answer the same.
    keys = block_keys(ids, f"remote:{prefill.host}", 16)  # the prefill agent's host, no port
    path = root / block_name(fp, keys[10], UNSALTED)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    # Block 20's file a sparse 2 GiB one, block 30's a FIFO: the start's scan drops both
    # without reading them (a FIFO would block a plain open).
    planted = [root / block_name(fp, keys[i], UNSALTED) for i in (20, 30)]
    planted[0].unlink()
    with open(planted[0], "wb") as f:
        f.truncate(2 << 30)
    planted[1].unlink()
    os.mkfifo(planted[1])
    third = with_disk(pooled, root)
    try:
        hurt = ask(third, req)
        assert hurt.metrics.disk_cached_tokens == 10 * 16  # the chain stops at the bad block
        assert hurt.token_ids == cold.token_ids
        assert third.status()["prefix_disk"]["corrupt"] == 3
        assert not any(p.exists() and p.stat().st_size > 1 << 20 for p in planted)
        # A full budget evicts and never fails a request; 0 empties the directory.
        third.settings(prefix_disk_mb=0.1)
        other = ask(third, remote_request(prefill, long_prompt(600)[::-1], max_tokens=4))
        assert len(other.token_ids) == 4
        s = settled(third)  # whatever it wrote stays within the budget
        assert s["bytes"] <= s["max_bytes"] and s["evictions"] > 0
        third.settings(prefix_disk_mb=0)
        assert third.status()["prefix_disk"]["blocks"] == 0
        assert not [p for p in os.listdir(root) if p.endswith(".kv")]
    finally:
        third.stop()


def test_disagg_status_shows_the_disk_tier() -> None:
    from disagg.cli.render_fleet import _prefix_cache

    pc = {"hit_rate": 0.5, "queries": 4, "bytes": 1 << 20, "max_bytes": 1 << 30}
    disk = {"hits": 12, "bytes": 5 << 20, "max_bytes": 8 << 30}
    both = AgentStatus.from_json({"prefix_cache": pc, "prefix_disk": disk})
    assert "disk 12 hits, 5 MiB / 8,192 MiB" in _prefix_cache(both)
    memory_only = AgentStatus.from_json({"prefix_cache": pc})  # an agent without the tier
    assert "disk" not in _prefix_cache(memory_only)


def local_disk_answer(port: int, model: str, prompt: str) -> tuple[str, dict[str, str], float]:
    """A greedy completion from `serve`: its text, verdict fields and wall time."""
    t0 = time.perf_counter()
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0},
        timeout=180,
    )
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    fields = dict(p.strip().split("=", 1) for p in r.headers["x-disagg-verdict"].split(";"))
    fields["prompt_tokens"] = str(r.json()["usage"]["prompt_tokens"])
    return r.json()["choices"][0]["text"], fields, took


@pytest.mark.slow
def test_serve_local_twice_serves_a_2k_prompt_from_disk(tmp_path: Path) -> None:
    """`serve --local` on one cache dir, its disk tier on by default: the second start
    answers the same 2k-token prompt mostly from disk, with the same greedy text."""
    model = shared_tiny("llama")
    cache = tmp_path / "cache"
    env = {"DISAGG_CACHE": str(cache), "TMPDIR": str(tmp_path)}
    runs: list[tuple[str, dict[str, str], float]] = []
    for run in range(2):
        proc, port = start_serve("-m", str(model), log_path=tmp_path / f"serve{run}.log", env=env)
        try:
            runs.append(local_disk_answer(port, model.name, long_prompt()))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    (text, cold, cold_s), (again, warm, warm_s) = runs
    n = int(warm["prompt_tokens"])
    assert n >= 2000 and int(cold["from_disk"]) == 0
    assert int(warm["from_disk"]) >= 0.9 * n, warm
    # Both from the prefill agent, which the restart put on another port: the blocks'
    # namespace is its host alone.
    assert cold["path"] == warm["path"] == "remote", (cold, warm)
    assert again == text
    root = cache / "prefix-disk"
    agent_dir = root / model.name / "decode"
    assert stat.S_IMODE(agent_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "token").stat().st_mode) == 0o600
    files = list(agent_dir.glob("*.kv"))
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    print(
        f"2k prompt ({n} tokens): cold {cold_s:.2f}s, after a restart {warm_s:.2f}s, "
        f"{warm['from_disk']} tokens from disk"
    )


def test_local_disk_defaults_flags_and_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve --local's tier: on under the cache dir by default, bounded; 0 turns it
    off; each decode agent its own directory; one token kept for the next start."""
    from disagg.errors import AgentError
    from disagg.serving.localagents import make_token_file
    from disagg.serving.localdisk import DEFAULT_MB, local_disk

    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    said: list[str] = []
    disk = local_disk(None, None, said.append)
    assert disk is not None and disk.root == tmp_path / "cache" / "prefix-disk"
    assert 0 < disk.mb <= DEFAULT_MB and stat.S_IMODE(disk.root.stat().st_mode) == 0o700
    assert local_disk(str(tmp_path / "d"), 0, said.append) is None
    assert disk.agent_dir("M", "decode@127.0.0.1") != disk.agent_dir("M", "decode-2@127.0.0.1")
    path, token = make_token_file(disk.root)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32
    assert make_token_file(disk.root) == (path, token)  # the next start's
    path.chmod(0o644)
    with pytest.raises(AgentError, match="not a token file of ours"):
        make_token_file(disk.root)
    assert not said

"""The disk tier as trusted storage (disagg_agents.prefix.disk, .blockfile), against
a local user or a careless operator with real files: owner-only files, a keyed MAC
over header and payload (a swapped block, a rewritten header), sizes checked before
a read (a sparse 2 GiB file), regular files only (a FIFO, a symlink), a tenant's
share of the budget, and key material that survives a restart."""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from disagg.frontends.guard import Guard, cache_salt
from disagg_agents.prefix.blockfile import MAGIC, tenant_tag
from disagg_agents.prefix.disk import DiskTier, fingerprint_digest
from disagg_agents.prefix.store import Block, block_keys

FP = fingerprint_digest({"architecture": "llama", "layers": 2})
SECRET = b"t" * 64


def block(seed: int) -> Block:
    rng = np.random.default_rng(seed)
    pairs = tuple((rng.standard_normal((2, 16, 8), np.float32),) * 2 for _ in range(2))
    return Block(pairs, sum(p[0].nbytes * 2 for p in pairs))


def written(tmp_path: Path, *keys: bytes, tenant: str | None = None) -> DiskTier:
    disk = DiskTier(tmp_path, 1 << 20, FP, SECRET)
    for i, k in enumerate(keys):
        disk.put(k, block(i), tenant)
    disk.flush()
    return disk


def dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "disagg.prefix"]


A, B = b"a" * 16, b"b" * 16


def test_files_and_their_directory_are_the_owners_alone(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)  # as an older release left it
    disk = written(root, A)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    files = list(root.iterdir())
    assert any(p.suffix == ".kv" for p in files)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name
    disk.close()


def test_a_block_swapped_in_from_another_prompt_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = written(tmp_path, A, B)
    (tmp_path / disk.name(A)).write_bytes((tmp_path / disk.name(B)).read_bytes())
    with caplog.at_level(logging.WARNING, "disagg.prefix"):
        assert disk.get(A) is None
    assert any("unusable" in m for m in dropped(caplog))
    assert disk.snapshot()["corrupt"] == 1 and disk.get(B) is not None


def test_a_header_rewritten_to_another_key_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """B's file with its header's key rewritten to A's (a valid header, the same
    length), under A's name: the MAC covers the header."""
    disk = written(tmp_path, A, B)
    data = (tmp_path / disk.name(B)).read_bytes()
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    head = json.loads(data[start : start + n])
    assert head["key"] == B.hex()
    head["key"] = A.hex()
    raw = json.dumps(head).encode()
    assert len(raw) == n
    (tmp_path / disk.name(A)).write_bytes(data[:start] + raw + data[start + n :])
    with caplog.at_level(logging.WARNING, "disagg.prefix"):
        assert disk.get(A) is None
    assert any("MAC" in m for m in dropped(caplog))


def test_another_key_material_reads_nothing_the_same_reads_all(tmp_path: Path) -> None:
    """Blocks written under one cluster token: a restart with the same token reads them
    (the MAC key is derived, not per process); files written under another do not pass."""
    written(tmp_path, A).close()
    same = DiskTier(tmp_path, 1 << 20, FP, SECRET)
    assert same.get(A) is not None
    same.close()
    other = DiskTier(tmp_path, 1 << 20, FP, b"u" * 64)
    assert other.get(A) is None and other.snapshot()["corrupt"] == 1


def sparse(path: Path, size: int = 2 << 30) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # no block of it on disk
    assert path.stat().st_blocks == 0


def test_a_sparse_2gib_file_is_never_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    disk = written(tmp_path, A, B)
    sparse(tmp_path / disk.name(A))  # after the tier indexed it: caught at the read
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, "disagg.prefix"):
            assert disk.get(A) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # nothing of it was read into memory
    assert any("bytes where a block" in m for m in dropped(caplog))
    disk.close()
    sparse(tmp_path / disk.name(B))  # before a restart: caught by the scan
    with caplog.at_level(logging.WARNING, "disagg.prefix"):
        again = DiskTier(tmp_path, 1 << 20, FP, SECRET, max_file=1 << 20)
    assert not (tmp_path / disk.name(B)).exists() and again.snapshot()["bytes"] == 0
    assert any("more than a block" in m for m in dropped(caplog))


def in_time(fn: object, timeout_s: float = 5.0) -> object:
    """fn() on a thread; fails the test if it has not returned in `timeout_s`."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "blocked"
    return out[0]


def test_a_fifo_is_a_miss_and_never_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = written(tmp_path, A, B)
    for key in (A, B):
        (tmp_path / disk.name(key)).unlink()
        os.mkfifo(tmp_path / disk.name(key))  # no writer: a plain open would wait forever
    with caplog.at_level(logging.WARNING, "disagg.prefix"):
        assert in_time(lambda: disk.get(A)) is None
    assert any("not a regular file" in m for m in dropped(caplog))
    disk.close()
    again = in_time(lambda: DiskTier(tmp_path, 1 << 20, FP, SECRET))
    assert isinstance(again, DiskTier) and not (tmp_path / disk.name(B)).exists()


def test_a_symlink_is_a_miss_even_to_a_sound_block(tmp_path: Path) -> None:
    disk = written(tmp_path, A, B)
    target = tmp_path.parent / f"{tmp_path.name}-elsewhere.kv"
    os.replace(tmp_path / disk.name(A), target)
    os.symlink(target, tmp_path / disk.name(A))
    assert disk.get(A) is None and target.exists()  # the link went, not its target
    assert not (tmp_path / disk.name(A)).is_symlink()


def test_one_agent_per_directory(tmp_path: Path) -> None:
    disk = written(tmp_path, A)
    with pytest.raises(ValueError, match="in use"):
        DiskTier(tmp_path, 1 << 20, FP, SECRET)
    disk.close()
    DiskTier(tmp_path, 1 << 20, FP, SECRET).close()


def test_b_keeps_its_share_of_the_disk_under_a_flood(tmp_path: Path) -> None:
    """B's three blocks, then A writes blocks worth four budgets: every one of B's is
    still there; A never holds more than its share."""
    probe = written(tmp_path / "probe", A, tenant="salt-x")
    one = (tmp_path / "probe" / probe.name(A, "salt-x")).stat().st_size
    disk = DiskTier(tmp_path / "d", 10 * one, FP, SECRET)
    b_keys = [bytes([i]) * 16 for i in range(3)]
    for i, k in enumerate(b_keys):
        disk.put(k, block(i), "salt-b")
    disk.flush()
    for i in range(40):
        disk.put(bytes([100 + i]) * 16, block(i), "salt-a")
        disk.flush()
        a_bytes = disk.tenant_bytes.get(tenant_tag("salt-a"), 0)
        assert a_bytes <= 0.5 * disk.max_bytes
    assert all(disk.get(k, "salt-b") is not None for k in b_keys)
    assert all(disk.get(k) is None for k in b_keys)  # another tenant's names: no hit
    s = disk.snapshot()
    assert s["bytes"] <= s["max_bytes"] and s["tenants"] == 2


def test_a_tenant_alone_may_fill_it_then_shrinks_to_its_share(tmp_path: Path) -> None:
    probe = written(tmp_path / "probe", A, tenant="salt-x")
    one = (tmp_path / "probe" / probe.name(A, "salt-x")).stat().st_size
    disk = DiskTier(tmp_path / "d", 10 * one, FP, SECRET)
    for i in range(10):
        disk.put(bytes([i]) * 16, block(i), "salt-b")  # alone: the whole budget
    disk.flush()
    assert disk.snapshot()["blocks"] == 10
    for i in range(40):
        disk.put(bytes([100 + i]) * 16, block(i), "salt-a")
    disk.flush()
    kept = sum(disk.get(bytes([i]) * 16, "salt-b") is not None for i in range(10))
    assert kept == 5  # its share: A's flood took the rest, never more


def tenant_salt(token: bytes | None, api_key: str = "key-b") -> str | None:
    """The salt a fresh gateway (guard) given `token` puts on a request with `api_key`."""
    from starlette.requests import Request

    guard = Guard(app=None, api_key=["key-op", api_key], salt_secret=token)  # type: ignore[arg-type]
    scope = {
        "type": "http",
        "path": "/v1/models",
        "headers": [(b"authorization", f"Bearer {api_key}".encode())],
    }
    assert guard.authorized(scope)
    return cache_salt(Request(scope))


def test_tenant_salts_survive_a_restart_of_the_gateway(tmp_path: Path) -> None:
    """The salt key comes from the cluster token: a second gateway (a restart) gives a
    key the same salt, so its chained block keys, and its blocks on disk, are found
    again; another token gives other salts; without one, each process its own."""
    token = b"c" * 64
    first, second = tenant_salt(token), tenant_salt(token)
    assert first is not None and first == second != tenant_salt(b"d" * 64)
    assert tenant_salt(None) != tenant_salt(None)
    ids = list(range(64))
    keys = block_keys(ids, "remote:127.0.0.1", salt=first)
    disk = DiskTier(tmp_path, 1 << 20, FP, token)
    disk.put(keys[0], block(0), keys.tenant)  # type: ignore[attr-defined]
    disk.close()
    again = block_keys(ids, "remote:127.0.0.1", salt=second)
    assert DiskTier(tmp_path, 1 << 20, FP, token).get(again[0], second) is not None

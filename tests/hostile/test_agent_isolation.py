"""Tenants and strangers at live agents (tiny model, token, 127.0.0.0/8):
prefix-cache tenants kept apart by the salt on both agents; a bit flipped on the path
in a K/V frame (a relay between the agents) refused before anything is placed or
cached; strangers filling the unauthenticated pool while the cluster's own connections
still get in; hostile safetensors headers answered with one line; an agent's ERROR
text with escapes and markup shown as plain text by the CLI. Figures are printed for
docs/reliability.md."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ModelError
from disagg.serving.localagents import AgentProc, wait_ready
from disagg_agents.prefix.store import block_keys
from disagg_agents.wire.auth import _mac, client_auth, server_auth
from disagg_agents.wire.channel import recv_json, send_json
from disagg_agents.wire.frames import Frame, PeerAuthError, ProtocolError, RemoteError
from tests.conftest import (
    DisaggProcess,
    LocalServer,
    PairFactory,
    Spawn,
    ask,
    log_since,
    log_size,
    remote_request,
)
from tests.tinymodels import shared_tiny

pytestmark = [pytest.mark.fault, pytest.mark.auth, pytest.mark.slow]

PER_PEER = 8
MAX_CONNECTIONS = 64  # so 32 unauthenticated at most: 4 strangers x 8 fill them
LONG = " ".join(["The vault code of the north tower is 4711 and nobody else may know it."] * 4)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., Path]) -> Path:
    return shared_tiny("llama")


@pytest.fixture(scope="module")
def agents(model: Path, agent_pair: PairFactory) -> list[AgentProc]:
    flags = [
        "--handshake-timeout",
        "3",
        "--max-preauth-per-peer",
        str(PER_PEER),
        "--max-connections",
        str(MAX_CONNECTIONS),
    ]
    return list(agent_pair(model, prefill_args=flags, decode_args=flags))


def target(agent: AgentProc, **extra: Any) -> dict[str, Any]:
    return {"host": agent.host, "port": agent.port, "timeout": 30, **extra}


# -- 1. the prefix cache: one tenant's prompts never answer another's probe ------


def test_salts_keep_tenants_apart_on_both_agents(agents: list[AgentProc]) -> None:
    prefill, decode = agents
    secret = remote_request(target(prefill), LONG, max_tokens=2)
    a = {**secret, "cache_salt": "tenant-a"}
    ask(decode, a)
    again = ask(decode, a)
    # The owner's repeat hits (the decode side's blocks; the prefill side's too).
    assert (again.metrics.cached_tokens or 0) >= 48, again.metrics
    # Each probe a tenant's first look (its own cache empty): B's right guess, C's wrong one.
    wrong = {**a, "prompt": LONG.replace("4711", "1234"), "cache_salt": "tenant-c"}
    probes = {
        "right guess": ask(decode, {**secret, "cache_salt": "tenant-b"}),
        "wrong guess": ask(decode, wrong),
        "no salt": ask(decode, secret),
    }
    for name, r in probes.items():
        m = r.metrics
        print(f"{name}: cached_tokens {m.cached_tokens}, prefill side {m.prefill_cached_tokens}")
        assert m.method == "disaggregated", m
        assert m.cached_tokens == 0 and m.prefill_cached_tokens == 0, (name, m)
    # The same salt shares, as vLLM's cache_salt: tenant-b's right guess is now its own.
    shared = ask(decode, {**secret, "cache_salt": "tenant-b"})
    assert (shared.metrics.cached_tokens or 0) >= 48


def test_the_salt_changes_every_block_key() -> None:
    ids = list(range(64))
    plain, a, b = (block_keys(ids, "remote:x", salt=s) for s in (None, "a", "b"))
    assert len(plain) == 4
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)


# -- 3. integrity after the handshake ---------------------------------------------


class FlippingRelay(LocalServer):
    """Forwards a decode agent's connections to the prefill agent; on the first,
    flips one bit of the prefill agent's answer `at` bytes in (inside the K/V)."""

    def __init__(self, upstream: AgentProc, at: int) -> None:
        self.upstream = (upstream.host, upstream.port)
        self.at = at
        self.flipped = 0
        self.connections = 0
        super().__init__()

    def on_connection(self, conn: socket.socket) -> None:
        up = socket.create_connection(self.upstream, timeout=30)
        self.connections += 1
        first = self.connections == 1

        def pump(src: socket.socket, dst: socket.socket, flip: bool) -> None:
            seen = 0
            with contextlib.suppress(OSError):
                while data := src.recv(1 << 16):
                    if flip and seen <= self.at < seen + len(data):
                        i = self.at - seen
                        data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :]
                        self.flipped += 1
                    seen += len(data)
                    dst.sendall(data)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump, args=(conn, up, False), daemon=True).start()
        pump(up, conn, first)


@pytest.mark.parametrize("integrity", ["none", "mac"])
def test_a_bit_flipped_in_a_kv_frame(agents: list[AgentProc], integrity: str) -> None:
    prefill, decode = agents
    logged = log_size(prefill), log_size(decode)
    clean = ask(decode, remote_request(target(prefill), LONG, max_tokens=8, prefix_cache=False))
    # Past the handshake and HELLO_OK (~1 kB), inside layer 0's K/V.
    relay = FlippingRelay(prefill, at=4000)
    try:
        bent = {"host": "127.0.0.1", "port": relay.port, "timeout": 30, "integrity": integrity}
        req = remote_request(bent, LONG, max_tokens=8, cache_salt=f"flip-{integrity}")
        got = ask(decode, req)
        after = ask(decode, req)  # the same path, now clean: does it reuse what came first?
    finally:
        relay.close()
    assert relay.flipped == 1 and relay.connections == 2
    m = got.metrics
    print(f"integrity {integrity}: method {m.method}, {m.fallback_reason}")
    if integrity == "none":
        # The finding: the altered K/V is taken as is, and its blocks are cached
        # for every later prompt sharing the prefix.
        assert m.method == "disaggregated"
        assert (after.metrics.cached_tokens or 0) >= 48
        return
    assert m.method == "local-fallback", m
    assert "integrity check" in (m.fallback_reason or "")
    assert got.token_ids == clean.token_ids  # computed locally, right
    # Nothing from the altered stream was cached: the clean retry over the same
    # path finds no block of it, and its tokens are the clean ones.
    assert after.metrics.method == "disaggregated"
    assert after.metrics.cached_tokens == 0, after.metrics
    assert after.token_ids == clean.token_ids
    assert "integrity check" in log_since(prefill, logged[0]) + log_since(decode, logged[1])


def test_a_client_that_asks_for_tags_refuses_an_agent_without_them() -> None:
    a, b = socket.socketpair()
    with a, b:
        # An older agent: its challenge offers no integrity.
        nonce = os.urandom(32).hex()
        send_json(b, Frame.CHALLENGE, {"nonce": nonce, "auth": True})
        with pytest.raises(PeerAuthError, match='integrity = "none"'):
            client_auth(a, b"t" * 64, "mac")


def test_stripping_the_mode_on_the_path_fails_the_proof(agents: list[AgentProc]) -> None:
    _, decode = agents
    token = decode.token
    assert token is not None
    with socket.create_connection((decode.host, decode.port), timeout=10) as s:
        _, ch = recv_json(s, Frame.CHALLENGE)
        cn = os.urandom(32)
        mac = _mac(token, b"client", bytes.fromhex(ch["nonce"]), cn, "mac")
        # What a client asking for "mac" proves, with "integrity" removed on the path.
        send_json(s, Frame.AUTH, {"nonce": cn.hex(), "mac": mac.hex()})
        with pytest.raises(RemoteError, match="wrong token"):
            recv_json(s, Frame.AUTH_OK)


# -- 4. strangers cannot lock the cluster out --------------------------------------


def _refused(host: str, port: int, src: str) -> bool:
    """Whether a connection from `src` is closed at once, unchallenged."""
    with socket.create_connection((host, port), 5, (src, 0)) as s:
        s.settimeout(5)
        return s.recv(1) == b""


def _cut(s: socket.socket) -> bool:
    """Whether the agent has shut `s` (its challenge, if any, read and dropped)."""
    s.setblocking(False)
    try:
        while s.recv(4096):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_strangers_filling_the_pool_do_not_block_the_cluster(agents: list[AgentProc]) -> None:
    prefill, decode = agents
    held: dict[tuple[int, str], list[socket.socket]] = {}
    stop = threading.Event()

    def stranger(agent: AgentProc, src: str, port: int, full: threading.Event) -> None:
        # Open PER_PEER silent sockets from `src` and hold them (the agent cuts them
        # after --handshake-timeout; the checks below come well before).
        mine = held.setdefault((port, src), [])
        while len(mine) < PER_PEER and not stop.is_set():
            try:
                mine.append(socket.create_connection((agent.host, port), 5, (src, 0)))
            except OSError:
                time.sleep(0.05)
        full.set()

    fills = [
        (a, f"127.0.20.{i}", port, threading.Event())
        for a in agents
        for port in (a.port, a.control_port)
        for i in range(1, 5)
    ]
    threads = [threading.Thread(target=stranger, args=f, daemon=True) for f in fills]
    for t in threads:
        t.start()
    try:
        assert all(full.wait(30) for *_, full in fills), "the strangers never got their sockets"
        # Four strangers hold all 32 unauthenticated slots. One over its own cap is
        # refused outright...
        assert _refused(decode.host, decode.port, "127.0.20.1"), "a ninth socket of one peer"
        # ... a newcomer from a fifth address is challenged, in the slot of the oldest
        # silent stranger, which the agent shuts...
        with socket.create_connection((decode.host, decode.port), 5, ("127.0.20.9", 0)) as s:
            s.settimeout(5)
            assert s.recv(1) != b"", "a newcomer found no slot: strangers locked it out"
        strangers = [s for i in range(1, 5) for s in held[(decode.port, f"127.0.20.{i}")]]
        deadline = time.monotonic() + 5
        while not any(_cut(s) for s in strangers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(_cut(s) for s in strangers), "no stranger was evicted for the newcomer"
        # ... and the cluster's own connections (loopback: the local pair) get in.
        t0 = time.monotonic()
        r = ask(decode, remote_request(target(prefill), max_tokens=4))
        took = time.monotonic() - t0
        status = decode.status()
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in (s for mine in held.values() for s in mine):
            s.close()
    print(f"4 strangers x {PER_PEER} sockets per port: the pair's request took {took:.2f} s")
    assert r.metrics.method == "disaggregated", r.metrics
    assert status["role"] == "decode"


# -- 7. hostile checkpoints ---------------------------------------------------------


def _hostile_dir(src: Path, dst: Path, edit: Callable[[dict[str, Any], bytes], bytes]) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.safetensors"):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        (dst / f.name).write_bytes(edit(header, raw[8 + n :]))
    return dst


def _pack(header: dict[str, Any] | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _first(header: dict[str, Any]) -> dict[str, Any]:
    return next(v for k, v in header.items() if k != "__metadata__")


def _past_end(h: dict[str, Any], d: bytes) -> bytes:
    e = _first(h)
    e["data_offsets"] = [e["data_offsets"][0], len(d) + 4096]
    return _pack(h, d)


def _bad_shape(h: dict[str, Any], d: bytes) -> bytes:
    _first(h)["shape"] = [7, 3]
    return _pack(h, d)


def _overlap(h: dict[str, Any], d: bytes) -> bytes:
    entries = sorted(
        (v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0]
    )
    a, b = entries[0], entries[1]
    span = b["data_offsets"][1] - b["data_offsets"][0]
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + span]
    return _pack(h, d)


HOSTILE: dict[str, Callable[[dict[str, Any], bytes], bytes]] = {
    "past the end": _past_end,
    "shape": _bad_shape,
    "overlap": _overlap,
    "deep": lambda h, d: _pack(b"[" * 100_000 + b"]" * 100_000, d),
    "huge int": lambda h, d: _pack(b'{"x": ' + b"9" * 5000 + b"}", d),
}


CASES = [("prefill", kind) for kind in HOSTILE] + [("decode", "past the end"), ("decode", "deep")]


@pytest.mark.parametrize("role, kind", CASES)
def test_a_hostile_checkpoint_gets_one_line(
    model: Path, tmp_path: Path, spawn: Spawn, role: str, kind: str
) -> None:
    bad = _hostile_dir(model, tmp_path / "bad", HOSTILE[kind])
    proc, log, name = spawn(role, bad)
    try:
        with pytest.raises(ModelError) as err:
            wait_ready(role, proc, log, name, timeout_s=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    line = str(err.value)
    print(f"{role} {kind}: {line}")
    assert "\n" not in line and "safetensors" in line, line
    assert "Traceback" not in log.read_text()


# -- 5. an agent's ERROR text on the operator's terminal -----------------------------


class EvilDecode(LocalServer):
    """A decode agent holding the token whose ERROR says hostile things."""

    MESSAGE = "\x1b[2J\x1b]0;pwned\x07[link=http://evil.example]click[/link] [/] done"

    def __init__(self, token: bytes) -> None:
        self.token = token
        super().__init__()

    def on_connection(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ProtocolError, PeerAuthError):
            conn.settimeout(10)
            server_auth(conn, self.token)
            recv_json(conn, Frame.GENERATE)
            send_json(conn, Frame.ERROR, {"code": "decode_failed", "message": self.MESSAGE})


def test_an_agents_error_text_reaches_the_terminal_as_plain_text(
    tmp_path: Path, disagg_process: DisaggProcess
) -> None:
    token = os.urandom(32).hex().encode()
    token_file = tmp_path / "token"
    token_file.write_bytes(token)
    token_file.chmod(0o600)
    evil = EvilDecode(token)
    inv = tmp_path / "inventory.toml"
    inv.write_text(
        f"""
[ssh]
config = ""
known_hosts = "{tmp_path}/known_hosts"

[hosts.box]
ssh = "127.0.0.1"
port = 1
data = ["127.0.0.1"]
roles = ["prefill", "decode"]
prefill = {{ port = 1, control_port = 3 }}
decode = {{ port = {evil.port}, control_port = 4 }}

[pipelines.m]
prefill = ["box"]
decode = ["box"]
prefill_model = "/m"
decode_model = "/m"
"""
    )
    env = {"DISAGG_TOKEN_FILE": str(token_file), "FORCE_COLOR": "1", "TERM": "xterm-256color"}
    try:
        # A process: the consoles take FORCE_COLOR and TERM when they are made.
        proc = disagg_process("generate", "-i", str(inv), "-m", "m", "hi", env=env, timeout=120)
    finally:
        evil.close()
    print(proc.stderr[-400:])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "\x1b[2J" not in proc.stderr and "\x1b]" not in proc.stderr and "\x07" not in proc.stderr
    assert "\x1b]8;" not in proc.stderr  # no live hyperlink
    assert "[link=http://evil.example]click[/link]" in proc.stderr  # the brackets, as text


def test_ipv6_counts_per_64_and_trusted_peers_have_their_own_slots() -> None:
    from disagg_agents.runtime.gate import Gate, peer_key, trusted_set

    assert peer_key("2001:db8::1") == peer_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert peer_key("2001:db8:0:1::1") != peer_key("2001:db8::1")
    assert peer_key("::ffff:10.0.0.1") == "10.0.0.1"
    gate = Gate(8, 2, trusted=trusted_set("10.0.0.5"))  # 4 unauthenticated slots for strangers
    strangers = [f"2001:db8::{i}" for i in range(3)] + ["192.0.2.1"] * 2 + ["192.0.2.2"] * 2
    admitted = [gate.admit(s) is None for s in strangers]
    assert admitted == [True, True, False, True, True, False, False]  # /64 cap 2, pool of 4
    for cluster in ("10.0.0.5", "127.0.0.1", "::1"):
        assert gate.admit(cluster) is None  # the pool is full, the cluster still gets in


def test_deploy_passes_the_inventorys_addresses_as_trusted_peers(tmp_path: Path) -> None:
    from disagg.fleet import service
    from disagg.fleet.deploy import inventory_addresses
    from disagg.fleet.inventory import load

    inv = load(Path(__file__).resolve().parents[2] / "inventory.toml")
    addresses = inventory_addresses(inv)
    assert "169.254.150.101" in addresses and "10.176.26.7" in addresses
    paths = service.AgentPaths(str(tmp_path), "decode")
    config = {
        "python": "python3", "model": "/m", "bind": "127.0.0.1", "port": 1, "control_port": 2,
        "name": "d", "dtype": "auto", "token_file": "/t", "trusted_peers": ",".join(addresses),
    }  # fmt: skip
    script = service.run_script(paths, config)
    assert "--trusted-peers" in script and "10.176.26.7" in script

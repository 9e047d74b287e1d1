"""Live settings (`PUT /settings` on an agent's control port): only a token holder
changes them, with a signed body; a change is checked whole and applied whole or
not at all; on real agents a change takes effect for the next connection or
request, with the model still loaded."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from disagg.serving.control import agent_settings
from disagg.serving.localagents import AgentProc
from disagg_agents.prefix.store import BlockStore
from disagg_agents.runtime.control import listener_settings, start_control
from disagg_agents.runtime.listener import FrameServer
from disagg_agents.runtime.settings import MAX_CHANGES, Setting, Settings, SettingsError
from disagg_agents.wire.frames import PeerAuthError
from disagg_agents.wire.httpauth import SCHEME, ControlError, _mac, control_put, parse_authorization
from tests.agenthelpers import FixedStatus
from tests.conftest import Cli, PairFactory, ask, log_since, log_size, remote_request
from tests.gateways import fleet_inventory
from tests.tinymodels import shared_tiny

TOKEN = b"t" * 32
LONG = " ".join(f"Stone {i} weighs {i * 7 % 11} grams." for i in range(12))


class Knobs:
    """Three settings of each kind over plain attributes."""

    def __init__(self) -> None:
        self.limit, self.deadline, self.on = 8, 1.5, False

    def settings(self) -> Settings:
        def field(name: str) -> Any:
            return lambda v: setattr(self, name, v)

        return Settings(
            Setting("limit", int, lambda: self.limit, field("limit"), 1, 100),
            Setting("deadline", float, lambda: self.deadline, field("deadline"), 0.1, 60.0),
            Setting("on", bool, lambda: self.on, field("on")),
        )


# ---- the registry ----------------------------------------------------------------------------


def test_a_change_applies_whole_and_says_what_changed() -> None:
    knobs = Knobs()
    settings = knobs.settings()
    changed = settings.change({"limit": 16, "deadline": 3, "on": True})
    assert changed == {"limit": [8, 16], "deadline": [1.5, 3.0], "on": [False, True]}
    assert (knobs.limit, knobs.deadline, knobs.on) == (16, 3.0, True)
    assert isinstance(knobs.deadline, float) and isinstance(knobs.limit, int)
    assert settings.change({"limit": 16}) == {}  # the same value: nothing to say
    assert settings.values() == {"deadline": 3.0, "limit": 16, "on": True}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"limit": 16, "nope": 1}, "no setting 'nope'; this agent has: deadline, limit, on"),
        ({"limit": 16, "on": 1}, "on takes true or false, not 1"),
        ({"deadline": 2, "limit": "16"}, "limit takes a number, not '16'"),
        ({"limit": 2.5}, "limit takes a whole number, not 2.5"),
        ({"limit": True}, "limit takes a number, not True"),
        ({"deadline": float("nan")}, "deadline takes a finite number"),
        ({"limit": 0}, "limit must lie in [1, 100]: 0"),
        ({"deadline": 61}, "deadline must lie in [0.1, 60]: 61"),
        ([("limit", 16)], "a change is a JSON object"),
        ({}, "a change is a JSON object"),
        ({f"k{i}": 1 for i in range(MAX_CHANGES + 1)}, f"at most {MAX_CHANGES} settings"),
    ],
)
def test_a_bad_change_is_one_line_and_changes_nothing(change: Any, says: str) -> None:
    knobs = Knobs()
    with pytest.raises(SettingsError) as e:
        knobs.settings().change(change)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert (knobs.limit, knobs.deadline, knobs.on) == (8, 1.5, False)


def test_a_smaller_prefix_budget_evicts_at_once() -> None:
    from disagg_agents.prefix.store import Block

    cache = BlockStore(10_000, block=4, share=1)
    for i in range(8):
        cache.add([bytes([i])], lambda _i: Block((None,), 1000))
    assert cache.bytes == 8000
    cache.set_budget(3_500)
    assert cache.bytes == 3000 and cache.evictions == 5 and cache.request_cap == 3_500
    assert cache.longest([bytes([7])], 1) and not cache.longest([bytes([0])], 1)
    cache.set_budget(0)
    assert cache.bytes == 0 and not cache.blocks


# ---- the endpoint, in this process ------------------------------------------------------------


@pytest.fixture
def endpoint() -> Iterator[tuple[int, Knobs]]:
    knobs = Knobs()
    server = start_control(
        "127.0.0.1",
        0,
        lambda: FixedStatus({"ok": True}),
        lambda: "",
        TOKEN,
        threading.Event(),
        settings=knobs.settings(),
    )
    try:
        yield server.server_address[1], knobs
    finally:
        server.shutdown()
        server.server_close()


def raw_put(port: int, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("PUT", "/settings", body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("WWW-Authenticate") or ""
    finally:
        conn.close()


def test_a_token_holder_reads_and_changes_settings(endpoint: tuple[int, Knobs]) -> None:
    port, knobs = endpoint
    assert agent_settings("127.0.0.1", port, TOKEN) == {"deadline": 1.5, "limit": 8, "on": False}
    after = agent_settings("127.0.0.1", port, TOKEN, {"limit": 32, "on": True})
    assert after == {"deadline": 1.5, "limit": 32, "on": True} and knobs.limit == 32
    with pytest.raises(ValueError, match=r"^limit must lie in \[1, 100\]: 1000$"):
        agent_settings("127.0.0.1", port, TOKEN, {"limit": 1000, "on": False})
    assert knobs.limit == 32 and knobs.on is True  # refused whole
    with pytest.raises(PeerAuthError):
        agent_settings("127.0.0.1", port, b"w" * 32, {"limit": 9})
    assert knobs.limit == 32


def test_the_mac_covers_the_body(endpoint: tuple[int, Knobs]) -> None:
    """A body swapped on the way (signed {"limit": 9}, sent {"limit": 99}) is refused:
    whoever sits between client and agent cannot change what the token holder asked."""
    port, knobs = endpoint
    status, _, challenge = raw_put(port, b"{}")
    assert status == 401
    nonce = (parse_authorization(challenge) or {})["nonce"]
    cnonce = "ab" * 16
    signed = hashlib.sha256(b'{"limit": 9}').hexdigest()
    mac = _mac(TOKEN, "client", "PUT", "/settings", nonce, cnonce, signed)
    auth = f'{SCHEME} nonce="{nonce}", cnonce="{cnonce}", mac="{mac}"'
    status, _, _ = raw_put(port, b'{"limit": 99}', {"Authorization": auth})
    assert status == 401 and knobs.limit == 8
    # The body it signed goes through, once: a nonce is spent by a valid MAC.
    status, answer, _ = raw_put(port, b'{"limit": 9}', {"Authorization": auth})
    assert status == 200 and json.loads(answer)["changed"] == {"limit": [8, 9]}
    status, _, _ = raw_put(port, b'{"limit": 10}', {"Authorization": auth})
    assert status == 401 and knobs.limit == 9


def test_a_body_too_large_or_without_length_is_refused_unread(
    endpoint: tuple[int, Knobs],
) -> None:
    port, knobs = endpoint
    status, answer, _ = raw_put(port, b"x" * 5000)
    assert status == 413 and b"Content-Length of at most 4096" in answer
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PUT /settings HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(200).startswith(b"HTTP/1.0 413")
    with pytest.raises(ControlError) as e:
        control_put("127.0.0.1", port, "/elsewhere", TOKEN, b"{}")
    assert e.value.status == 404
    assert knobs.limit == 8


def test_an_agent_without_a_token_takes_no_changes() -> None:
    knobs = Knobs()
    server = start_control(
        "127.0.0.1", 0, FixedStatus, str, None, threading.Event(), settings=knobs.settings()
    )
    try:
        status, answer, _ = raw_put(server.server_address[1], b'{"limit": 9}')
    finally:
        server.shutdown()
        server.server_close()
    assert status == 403 and b"without a cluster token" in answer and knobs.limit == 8


def test_a_live_handshake_deadline_bounds_the_next_control_request_too() -> None:
    """handshake_timeout_s is both ports' deadline: a control port started with 30 s
    cuts a silent HTTP client at the new 0.5 s (read per connection)."""
    frames = FrameServer("127.0.0.1", 0, lambda sock, peer: None, TOKEN, 30.0)
    control = start_control("127.0.0.1", 0, FixedStatus, str, TOKEN, threading.Event(), 30.0)
    try:
        live = Settings(*listener_settings([frames], [control]))
        live.change({"handshake_timeout_s": 0.5})
        assert frames.handshake_timeout_s == 0.5
        with socket.create_connection(("127.0.0.1", control.server_address[1]), timeout=10) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /status HTTP/1.1\r\n")  # and nothing more
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):
                    pass
            assert 0.4 <= time.monotonic() - t0 < 5  # the recv's 10 s would raise first
    finally:
        control.shutdown()
        control.server_close()
        frames.server_close()


# ---- real agents --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(shared_tiny("llama"))


@pytest.fixture
def restored(llama: tuple[AgentProc, AgentProc]) -> Iterator[tuple[AgentProc, AgentProc]]:
    """The pooled pair, its own settings put back after the test (others share it)."""
    own = [agent.settings() for agent in llama]
    try:
        yield llama
    finally:
        for agent, values in zip(llama, own, strict=True):
            agent.settings(**values)


@pytest.mark.slow
def test_a_live_handshake_deadline_cuts_the_next_silent_peer(
    restored: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = restored
    prefill.settings(handshake_timeout_s=120.0)  # the old deadline: past any recv below
    at = log_size(prefill)
    after = prefill.settings(handshake_timeout_s=0.5)
    assert after["handshake_timeout_s"] == 0.5
    assert "settings changed by 127.0.0.1: " in log_since(prefill, at)
    # A peer that says nothing is cut at the new deadline, not before it; not at the
    # old one: the recv's 60 s timeout (raised, not suppressed) would end it first.
    with socket.create_connection((prefill.host, prefill.port), timeout=60) as s:
        t0 = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            while s.recv(4096):
                pass
        assert time.monotonic() - t0 >= 0.5  # the bound the agent enforces, read back
    # A data port capped at 2 connections (1 unauthenticated): a second silent peer
    # takes the first one's slot, and the first is closed at once: with the handshake
    # deadline far past the recv's 30 s timeout, only the cap can have closed it.
    prefill.settings(handshake_timeout_s=120.0, max_connections=2)
    with socket.create_connection((prefill.host, prefill.port), timeout=30) as first:
        assert first.recv(4096)  # its challenge: it had a slot
        with socket.create_connection((prefill.host, prefill.port), timeout=30) as second:
            assert second.recv(4096)
            with contextlib.suppress(ConnectionResetError):
                while first.recv(4096):
                    pass
    prefill.settings(handshake_timeout_s=5.0, max_connections=512)
    # The agents still answer, with the model loaded all along.
    res = ask(decode, remote_request(prefill))
    assert res.metrics.method == "disaggregated" and len(res.token_ids) == 8


@pytest.mark.slow
def test_a_live_prefix_budget_of_zero_turns_reuse_off(
    restored: tuple[AgentProc, AgentProc],
) -> None:
    prefill, decode = restored
    req = remote_request(prefill, LONG, cache_salt=f"budget-{time.time()}")
    ask(decode, req)
    assert (ask(decode, req).metrics.cached_tokens or 0) > 0
    decode.settings(prefix_cache_mb=0)
    assert decode.status()["prefix_cache"]["bytes"] == 0
    again = remote_request(prefill, LONG, cache_salt=f"off-{time.time()}")
    ask(decode, again)
    assert ask(decode, again).metrics.cached_tokens == 0


@pytest.mark.slow
def test_a_bad_change_to_a_real_agent_is_one_line(llama: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = llama
    before = prefill.settings()
    with pytest.raises(ValueError, match=r"^no setting 'allow_mixed'; this agent has: "):
        prefill.settings(allow_mixed=True)  # a decode agent's setting
    with pytest.raises(ValueError, match=r"^max_connections must lie in \[2, 65536\]: 1$"):
        decode.settings(max_connections=1)
    assert prefill.settings() == before


# ---- disagg tune ----------------------------------------------------------------------------


@pytest.mark.slow
def test_disagg_tune_shows_and_changes_a_fleets_agents(
    llama: tuple[AgentProc, AgentProc],
    agent_pair: PairFactory,
    cli: Cli,
    tmp_path: Path,
) -> None:
    prefill, decode = llama
    agents = agent_pair.set(shared_tiny("llama"))
    inv = fleet_inventory(tmp_path, agents, shared_tiny("llama"))
    env = {"DISAGG_TOKEN_FILE": str(agent_pair.token_file)}
    shown = cli("tune", "-i", str(inv), "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    rows = {r["role"]: r for r in json.loads(shown.stdout)}
    assert rows["prefill"]["settings"] == prefill.settings()
    assert rows["decode"]["settings"]["allow_mixed"] is False
    assert rows["decode"]["address"] == f"127.0.0.1:{decode.control_port}"
    own = decode.settings()
    try:
        done = cli(
            "tune", "-i", str(inv), "--role", "decode",
            "--set", "allow_mixed=true", "--set", "prefix_cache_mb=1.5", env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "live settings (changed)" in done.stdout and "prefix_cache_mb = 1.5" in done.stdout
        assert (
            decode.settings()["allow_mixed"] is True
            and prefill.settings() == rows["prefill"]["settings"]
        )
        # A change the agent refuses: its one line, exit 1, nothing changed.
        bad = cli("tune", "d", "-i", str(inv), "--set", "max_connections=1", env=env)
        assert bad.returncode == 1
        assert "max_connections must lie in [2, 65536]: 1" in bad.stdout
        assert decode.settings()["max_connections"] == own["max_connections"]
    finally:
        decode.settings(**own)
    usage = cli("tune", "-i", str(inv), "--set", "allow_mixed", env=env)
    assert usage.returncode == 1 and usage.stderr.count("\n") == 1
    assert "--set takes NAME=VALUE" in usage.stderr
    wrong = cli("tune", "-i", str(inv), env={"DISAGG_TOKEN_FILE": str(tmp_path / "none")})
    assert wrong.returncode == 1 and "requires the cluster token" in wrong.stdout


def test_disagg_tune_says_which_agent_it_could_not_reach(cli: Cli, tmp_path: Path) -> None:
    inv = tmp_path / "inventory.toml"
    ports = []
    for _ in range(4):
        free = socket.create_server(("127.0.0.1", 0))
        ports.append(free.getsockname()[1])
        free.close()  # nobody listens there now
    port = ports[1]
    inv.write_text(
        f"""
[hosts.p]
ssh = "127.0.0.1"
data = ["127.0.0.1"]
roles = ["prefill"]
prefill = {{ port = {ports[0]}, control_port = {port} }}

[hosts.d]
ssh = "127.0.0.1"
data = ["127.0.0.1"]
roles = ["decode"]
decode = {{ port = {ports[2]}, control_port = {ports[3]} }}

[pipelines.m]
prefill = ["p"]
decode = ["d"]
prefill_model = "/m"
decode_model = "/m"
"""
    )
    token = tmp_path / "token"
    token.write_text("x" * 40)
    token.chmod(0o600)
    done = cli(
        "tune", "-i", str(inv), "--role", "prefill", "--json",
        env={"DISAGG_TOKEN_FILE": str(token)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["error"] == (
        f"control port {port} not reachable from here (127.0.0.1): is it started?"
    )

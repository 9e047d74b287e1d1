"""Authentication: every agent endpoint but GET /health wants the cluster token;
the KV socket proves it by challenge-response and never carries it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from disagg.errors import AuthError
from disagg.serving import wireclient as client
from disagg.serving.localagents import AgentProc, wait_ready
from disagg_agents.wire.auth import client_auth
from disagg_agents.wire.channel import recv_json, send_json
from disagg_agents.wire.frames import Frame, PeerAuthError, RemoteError
from disagg_agents.wire.httpauth import control_get
from tests.conftest import LocalServer, PairFactory, Spawn, ask, log_since, log_size
from tests.tinymodels import PROMPT, shared_tiny

pytestmark = [pytest.mark.auth, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model: Callable[..., Path]) -> Path:
    return shared_tiny("llama")


@pytest.fixture(scope="module")
def pair(tiny_dir: Path, agent_pair: PairFactory) -> tuple[AgentProc, AgentProc]:
    return agent_pair(tiny_dir)


def request(prefill_host: str, prefill_port: int) -> dict[str, object]:
    return {
        "prompt": PROMPT,
        "raw": True,
        "max_tokens": 4,
        "placement": "remote",
        "prefill": {"host": prefill_host, "port": prefill_port},
    }


def prefill_requests(prefill: AgentProc) -> int:
    return int(json.loads(prefill.control("/status"))["requests"])


def test_right_token_works(pair: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = pair
    res = ask(decode, request(prefill.host, prefill.port))
    assert res.metrics.method == "disaggregated" and res.token_ids


@pytest.mark.parametrize(
    "token, message",
    [
        (None, "requires the cluster token"),
        (b"0" * 64, "wrong token"),
    ],
)
def test_missing_or_wrong_token_is_refused_and_logged(
    pair: tuple[AgentProc, AgentProc], token: bytes | None, message: str
) -> None:
    prefill, decode = pair
    before, logged = prefill_requests(prefill), log_size(decode)
    with pytest.raises(AuthError, match=message):
        client.generate(decode.host, decode.port, request(prefill.host, prefill.port), token=token)
    assert prefill_requests(prefill) == before  # no work was done anywhere
    if token is not None:
        assert "refused 127.0.0.1" in log_since(decode, logged)


def test_prefill_agent_refuses_a_decode_side_without_the_token(
    pair: tuple[AgentProc, AgentProc],
) -> None:
    prefill, _ = pair
    before, logged = prefill_requests(prefill), log_size(prefill)
    with (
        socket.create_connection((prefill.host, prefill.port), timeout=5) as s,
        pytest.raises(PeerAuthError),
    ):
        client_auth(s, b"not-the-cluster-token")
    with socket.create_connection((prefill.host, prefill.port), timeout=5) as s:
        recv_json(s, Frame.CHALLENGE)
        send_json(s, Frame.HELLO, {"fingerprint": {}})  # skips AUTH entirely
        with pytest.raises(RemoteError, match="authentication required"):
            recv_json(s, Frame.HELLO_OK)
    assert prefill_requests(prefill) == before
    assert "refused 127.0.0.1" in log_since(prefill, logged)


def http_status(agent: AgentProc, path: str, token: str | None) -> int:
    """The status code of a bare GET or one with `Authorization: Bearer <token>`."""
    req = urllib.request.Request(f"http://{agent.host}:{agent.control_port}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_http_wants_proof_of_the_token_except_health(pair: tuple[AgentProc, AgentProc]) -> None:
    for agent in pair:
        assert agent.token is not None
        right = agent.token.decode()
        assert http_status(agent, "/health", None) == 200
        for path in ("/status", "/metrics"):
            assert http_status(agent, path, None) == 401
            assert http_status(agent, path, "wrong") == 401
            assert http_status(agent, path, right) == 401  # the token itself is no longer taken
            assert control_get(agent.host, agent.control_port, path, agent.token)
            with pytest.raises(PeerAuthError, match="refused our proof"):
                control_get(agent.host, agent.control_port, path, b"0" * 64)


class Recorder(LocalServer):
    """A TCP relay that keeps every byte it forwards, both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.seen = bytearray()
        self.lock = threading.Lock()
        super().__init__()

    def on_connection(self, a: socket.socket) -> None:
        b = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(b, a), daemon=True).start()
        self._pump(a, b)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def test_the_token_never_crosses_the_wire(pair: tuple[AgentProc, AgentProc]) -> None:
    prefill, decode = pair
    to_decode = Recorder((decode.host, decode.port))
    to_prefill = Recorder((prefill.host, prefill.port))
    res = client.generate(
        "127.0.0.1", to_decode.port, request("127.0.0.1", to_prefill.port), token=decode.token
    )
    assert res.metrics.method == "disaggregated"
    assert res.metrics.prefill_address == f"127.0.0.1:{to_prefill.port}"
    assert decode.token is not None
    for rec in (to_decode, to_prefill):
        assert b"CHALLENGE" not in rec.seen  # frames are binary, not names
        assert len(rec.seen) > 1000
        assert decode.token not in rec.seen and bytes.fromhex(decode.token.decode()) not in rec.seen


def test_a_token_file_others_can_read_is_refused(
    tiny_dir: Path, tmp_path: Path, spawn: Spawn
) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 64)
    os.chmod(token, 0o644)
    proc, log, name = spawn("decode", tiny_dir, extra_args=["--token-file", str(token)])
    from disagg.errors import ModelError

    with pytest.raises(ModelError, match="readable by others; fix: chmod 600"):
        wait_ready("decode", proc, log, name, timeout_s=60)


def test_agents_bind_only_the_addresses_they_are_given(
    pair: tuple[AgentProc, AgentProc],
) -> None:
    """Given `--host 127.0.0.1` (as every local agent is), each port of both agents
    answers there and nowhere else on loopback's /8 (127.0.0.2 is this machine too)."""
    for agent in pair:
        assert agent.host == "127.0.0.1"
        for port in (agent.port, agent.control_port):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.2", port), timeout=2)

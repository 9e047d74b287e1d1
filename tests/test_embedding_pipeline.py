"""An embedding pipeline (`embedding_model` in inventory.toml): parsed with one-line
errors, prefill agents only, and a gateway that sends its embeddings to the prefill
agent and refuses chat and generate with a 400 on every API. The embeddings
themselves, from a real deployed agent, are on the test bed (tests/testbed)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from disagg.api import Client
from disagg.fleet.inventory import InventoryError, load
from disagg.fleet.routing import router_from_inventory
from disagg.frontends.app import create_app
from disagg.serving.router import Endpoint, Route, Router
from tests.conftest import free_port

BASE = """
[ssh]
config = ""
known_hosts = "{known}"

[hosts.a]
ssh = "127.0.0.1"
roles = ["prefill"]

[hosts.b]
ssh = "127.0.0.1"
roles = ["prefill", "decode"]
prefill = {{ port = 9100, control_port = 9110 }}
decode = {{ port = 9101, control_port = 9111 }}
"""

EMBED = """
[pipelines.embed]
aliases = ["qwen3-embedding"]
prefill = ["a"]
embedding_model = "~/models/Qwen3-Embedding-0.6B"
"""

CHAT = """
[pipelines.chat]
prefill = ["HOST"]
decode = ["b"]
prefill_model = "m"
decode_model = "m"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.toml"
    path.write_text((BASE + text).format(known=tmp_path / "known_hosts"))
    return path


def test_embedding_pipeline_runs_prefill_agents_only(tmp_path: Path) -> None:
    chat = CHAT.replace("HOST", "b")
    inv = load(write(tmp_path, EMBED + chat))
    p = inv.pipelines["embed"]
    assert p.embedding and p.decode == () and p.prefill == ("a",)
    assert p.prefill_model == "~/models/Qwen3-Embedding-0.6B"
    assert not inv.pipelines["chat"].embedding
    assert [(a.label, a.model) for a in inv.agents()] == [
        ("a/prefill", "~/models/Qwen3-Embedding-0.6B"),
        ("b/decode", "m"),
        ("b/prefill", "m"),
    ]
    routes = router_from_inventory(inv).pipelines
    assert routes["embed"].embedding_only and routes["qwen3-embedding"].embedding_only
    assert routes["embed"].decode == [] and not routes["chat"].embedding_only


@pytest.mark.parametrize(
    "extra, key, words",
    [
        ('decode = ["b"]\n', "pipelines.embed.decode", "no decode side"),
        ('decode_model = "m"\n', "pipelines.embed.decode_model", "no decode side"),
        ('prefill_model = "m"\n', "pipelines.embed.prefill_model", "one model"),
        ("max_migrations = 1\n", "pipelines.embed.max_migrations", "no decode side"),
    ],
)
def test_decode_keys_on_an_embedding_pipeline_are_refused(
    tmp_path: Path, extra: str, key: str, words: str
) -> None:
    with pytest.raises(InventoryError) as e:
        load(write(tmp_path, EMBED + extra))
    msg = str(e.value)
    assert "\n" not in msg and f": {key}: " in msg and words in msg and "fix: remove" in msg


def test_embedding_pipeline_wants_prefill_hosts(tmp_path: Path) -> None:
    no_hosts = '[pipelines.e]\nembedding_model = "m"\n'
    with pytest.raises(InventoryError, match=r"pipelines\.e\.prefill: missing"):
        load(write(tmp_path, no_hosts))
    decode_host = BASE.replace('roles = ["prefill"]\n', 'roles = ["decode"]\n', 1)
    path = tmp_path / "inv.toml"
    path.write_text((decode_host + EMBED).format(known=tmp_path / "known_hosts"))
    with pytest.raises(InventoryError, match="host 'a' has no prefill role"):
        load(path)
    # One prefill agent per host: a chat pipeline there must load the same model.
    other = CHAT.replace("HOST", "a")
    with pytest.raises(InventoryError, match="already runs prefill for pipeline 'embed'"):
        load(write(tmp_path, EMBED + other))


# ---- the gateway over an embedding pipeline ---------------------------------------------


class Listener:
    """A TCP port that records connections (where the gateway sent the embeddings)
    and closes them: not an agent, so the request fails after it arrived."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


@pytest.fixture(scope="module")
def embedding_gateway() -> Iterator[tuple[str, Listener]]:
    agent = Listener()
    prefill = [Endpoint("prefill@a", "127.0.0.1", agent.port, None)]
    routes = [Route("embed", prefill, [], embedding_only=True)]
    app = create_app(Client(router=Router(routes)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}", agent
    server.should_exit = True
    agent.sock.close()


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/api/chat", {"messages": MESSAGES, "stream": False}),
        ("/api/chat", {"messages": MESSAGES}),  # Ollama streams by default
        ("/api/generate", {"prompt": "hi"}),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 8}),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 8, "stream": True}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/responses", {"input": "hi", "stream": True}),
    ],
)
def test_chat_and_generate_are_a_400(
    embedding_gateway: tuple[str, Listener], path: str, body: dict[str, Any]
) -> None:
    url, _ = embedding_gateway
    status, text = post(url + path, {"model": "embed", **body})
    assert status == 400, text
    assert "this model serves embeddings only" in text, text


def test_embeddings_go_to_the_prefill_agent(embedding_gateway: tuple[str, Listener]) -> None:
    url, agent = embedding_gateway
    for path, body in (
        ("/api/embed", {"input": "hi"}),
        ("/v1/embeddings", {"input": ["hi"]}),
    ):
        before = agent.accepted
        status, text = post(url + path, {"model": "embed", **body})
        # The listener is no agent: the error names the prefill agent it reached.
        assert status >= 500 and "prefill agent prefill@a" in text, (path, text)
        assert agent.accepted == before + 1


def test_show_says_embedding(embedding_gateway: tuple[str, Listener]) -> None:
    url, _ = embedding_gateway
    status, text = post(url + "/api/show", {"model": "embed"})
    assert status == 200, text
    assert json.loads(text)["capabilities"] == ["embedding"]

"""Hostile or odd answers at the control plane: /status bodies that are not an
object, nest 10k deep or carry rich markup; log lines with terminal escapes; an
empty token file. No sshd: the host's ssh port is closed, so `disagg status`
shows what the control port answered directly."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from disagg.cli.render_fleet import status_table
from disagg.fleet.operations import HostProbe, _http_status, strip_escapes
from disagg_agents.wire.status import AgentStatus
from tests.conftest import Cli

pytestmark = pytest.mark.fuzz

DEEP = b"[" * 10_000 + b"]" * 10_000


class FakeAgent:
    """An HTTP 'agent' answering GET /status with whatever body it is given."""

    def __init__(self) -> None:
        self.body = b"{}"
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(fake.body)))
                self.end_headers()
                self.wfile.write(fake.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def fake() -> Iterator[FakeAgent]:
    agent = FakeAgent()
    yield agent
    agent.close()


@pytest.mark.parametrize(
    "body, why",
    [
        (b"5", "JSON int, not an object"),
        (b"null", "JSON NoneType, not an object"),
        (b'"[/red]"', "JSON str, not an object"),
        (DEEP, "nests JSON too deeply"),
        (b"{not json", "not JSON"),
    ],
)
def test_a_malformed_status_answer_says_what_is_wrong(
    fake: FakeAgent, body: bytes, why: str
) -> None:
    fake.body = body
    got = _http_status(["127.0.0.1"], fake.port, None)
    assert isinstance(got, str) and why in got and f"127.0.0.1:{fake.port}" in got


def test_a_token_holder_refuses_an_agent_that_wants_none(fake: FakeAgent) -> None:
    fake.body = b'{"role": "decode"}'
    got = _http_status(["127.0.0.1"], fake.port, b"t" * 64)
    assert isinstance(got, str) and "asks for no cluster token" in got


def test_agent_strings_are_never_markup() -> None:
    rows = [
        HostProbe(
            "h",
            "decode",
            "healthy",
            "1.2.3.4:1",
            AgentStatus.from_json({"model": "[red]m", "backend": "[/bold]x\x1b[2J"}),
        ),
        HostProbe("h", "prefill", "bad answer", detail="1.2.3.4:2: [/] \x1b]0;t\x07"),
    ]
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(status_table(rows))
    text = out.getvalue()
    assert "[red]m" in text and "[/bold]x" in text and "\x1b" not in text and "bad answer" in text


def test_log_lines_lose_their_terminal_escapes() -> None:
    line = "2026 decode INFO \x1b[31mred\x1b[0m \x1b]0;title\x07 "
    line += "\x1b]8;;http://x\x1b\\link \x9b2J\x07!"
    assert strip_escapes(line) == "2026 decode INFO red  link \\x07!"


def inventory(tmp_path: Path, control_port: int) -> Path:
    path = tmp_path / "inventory.toml"
    path.write_text(
        f"""
[ssh]
config = ""
known_hosts = "{tmp_path}/known_hosts"
connect_timeout = 2

[hosts.box]
ssh = "127.0.0.1"
port = 1
data = ["127.0.0.1"]
roles = ["prefill", "decode"]
prefill = {{ port = 1, control_port = 3 }}
decode = {{ port = 2, control_port = {control_port} }}

[pipelines.m]
prefill = ["box"]
decode = ["box"]
prefill_model = "/m"
decode_model = "/m"
"""
    )
    return path


@pytest.mark.parametrize("body", [b"5", b"null", DEEP, b'{"model": "m", "backend": "[/red]"}'])
def test_disagg_status_shows_a_row_for_any_answer_and_exits_1(
    fake: FakeAgent, tmp_path: Path, body: bytes, cli: Cli
) -> None:
    fake.body = body
    inv = inventory(tmp_path, fake.port)
    env = {"DISAGG_TOKEN_FILE": str(tmp_path / "no-token")}
    proc = cli("status", "-i", str(inv), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "box" in proc.stdout and "decode" in proc.stdout, proc.stdout
    if body.startswith(b"{"):
        assert "[/red]" in proc.stdout  # shown as text, not taken as markup
    else:
        assert "bad answer" in proc.stdout, proc.stdout


@pytest.mark.auth
def test_deploy_refuses_an_empty_token_file_with_one_line(tmp_path: Path, cli: Cli) -> None:
    token = tmp_path / "token"
    token.write_text("")
    token.chmod(0o600)
    inv = inventory(tmp_path, 4)
    proc = cli("deploy", "-i", str(inv), env={"DISAGG_TOKEN_FILE": str(token)})
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"token file {token} is empty" in errors[0] and "fix: rm" in errors[0]

"""`disagg status` rendering: readable in an 80-column terminal (a short table,
details under it), one wide table where there is room."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from rich.console import Console

from disagg.cli.fleet import gateway_tables
from disagg.cli.render_fleet import status_table
from disagg.errors import UsageError
from disagg.fleet.operations import HostProbe
from disagg.serving.gatewaystatus import gateway_agents
from disagg_agents.wire.status import AgentStatus


def _agent(host: str, role: str, model: str, backend: str, device: str) -> HostProbe:
    return HostProbe(
        host=host,
        role=role,
        state="healthy",
        address=f"192.168.100.{11 if 'dgx' in host else 21}:{7100 if role == 'prefill' else 7200}",
        status=AgentStatus.from_json(
            {
                "model": f"/home/ops/models/fp4/{model}",
                "loaded": True,
                "backend": backend,
                "device": device,
                "uptime_s": 86400.5,
                "requests": 1234,
                "ttft_p50_s": 0.182,
                "ttft_p95_s": 1.104,
                "ttft_p99_s": 5.93,
            }
        ),
        pid=4242,
        rss_bytes=17 * 2**30,
    )


ROWS = [
    _agent("dgx-spark-1", "prefill", "Qwen3-Coder-30B-A3B-Instruct-4bit", "torch", "cuda:0"),
    _agent("mac-studio-2", "decode", "Qwen3-Coder-30B-A3B-Instruct-4bit", "mlx", "gpu"),
    _agent("dgx-spark-2", "prefill", "gpt-oss-120b", "torch", "cuda:0"),
    HostProbe(
        "mac-studio-1",
        "decode",
        "not responding",
        detail="connection refused on 192.168.100.22:7201; fix: disagg start mac-studio-1",
    ),
]


def render(width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(status_table(ROWS, width))
    return console.export_text().splitlines()


def test_status_at_80_columns_keeps_every_value_whole() -> None:
    lines = render(80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    # Each value on one line, never broken into one word per row.
    for whole in (
        "dgx-spark-1",
        "mac-studio-2",
        "not responding",
        "Qwen3-Coder-30B-A3B-Instruct-4bit",
        "torch/cuda:0",
        "192.168.100.21:7200",
        "182.0 ms / 1.104 s / 5.930 s",
    ):
        assert whole in text, whole
    table_rows = [line for line in lines if "dgx-spark-1" in line and "prefill" in line]
    assert table_rows and "healthy" in table_rows[0]
    assert any("connection refused" in line for line in lines)


def test_status_wide_is_one_table() -> None:
    lines = render(240)  # twelve columns, the prefix cache's included
    header = next(line for line in lines if "backend/device" in line)
    assert "memory" in header and "address" in header
    assert any("Qwen3-Coder-30B-A3B-Instruct-4bit" in line for line in lines)


def test_status_url_shows_the_decode_agents_disk_tier(cli: Any) -> None:
    """`disagg status --url` for `serve --local`: a gateway's agent rows (here a real
    HTTP server answering /ui/api/state as the web view does) with the disk tier."""
    import json

    agents = [
        {"name": "prefill@127.0.0.1", "role": "prefill", "model": "M", "up": True},
        {
            "name": "decode@127.0.0.1",
            "role": "decode",
            "model": "M",
            "up": True,
            "prefix_disk": {"hits": 3, "bytes": 5 << 20, "max_bytes": 64 << 20},
        },
    ]

    class State(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"operator": True, "agents": agents}).encode()
            self.send_response(200 if self.path == "/ui/api/state" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), State)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        proc = cli("status", "--url", url, env={"COLUMNS": "200"})
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if "@127.0.0.1" in ln]
    assert "3 hits, 5 MiB / 64 MiB" in rows[1] and "hits" not in rows[0], proc.stdout


GATEWAY_ROWS = [
    {"name": n, "role": n.split("@")[0].split("-")[0], "model": m, "up": True,
     "device": "cpu", "requests": 12345, "ttft_p50_s": 12.342}
    for n in ("prefill@127.0.0.1", "decode@127.0.0.1", "decode-2@127.0.0.1")
    for m in ("SmolLM2-135M-Instruct", "Qwen3-Coder-30B-A3B-Instruct-4bit")
]  # fmt: skip


def render_gateway(width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    for shown in gateway_tables(GATEWAY_ROWS, "http://127.0.0.1:8080", width):
        console.print(shown)
    return console.export_text().splitlines()


def test_gateway_status_at_80_columns_keeps_agent_names_whole() -> None:
    lines = render_gateway(80)
    assert all(len(line) <= 80 for line in lines), lines
    table = [line for line in lines if line.startswith("│")]
    for name in {r["name"] for r in GATEWAY_ROWS}:  # each on one line of the table
        assert sum(f"│ {name} " in line for line in table) == 2, (name, lines)
        assert f"{name}: " in "\n".join(lines), lines  # role and device under it
    wide = render_gateway(160)
    assert any("│ role" in line or " role " in line for line in wide), wide
    assert not any(": decode on cpu" in line for line in wide), wide


def test_status_url_without_a_key_says_one_is_needed() -> None:
    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(401)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(UsageError, match="needs an API key: set DISAGG_API_KEY"):
            gateway_agents(url, None)
        with pytest.raises(UsageError, match="refused the key in DISAGG_API_KEY"):
            gateway_agents(url, "wrong")
    finally:
        server.shutdown()
        server.server_close()

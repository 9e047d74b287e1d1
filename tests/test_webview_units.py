"""The web view's parts without a model: the gateway's Prometheus text (read
back with the official client's parser), the sign-in cookie through the real
guard on a real socket, the request log, crash lines from logs, and `disagg
logs`' stderr tail run by a real shell."""

from __future__ import annotations

import gzip
import json
import queue
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from disagg.api import Client
from disagg.fleet.crashes import crash_tail_command, last_error_from_tails
from disagg.fleet.operations import LogLine, log_commands, merge_by_time, pump_lines
from disagg.fleet.service import AgentPaths
from disagg.frontends.app import create_app
from disagg.frontends.webview import auth, prom
from disagg.frontends.webview.fleet import last_error_line
from disagg.frontends.webview.tracker import RequestLog, prompt_of
from disagg.serving.router import Endpoint, Route, Router, StopGeneration
from disagg_agents.wire.answer import Metrics, TokenEvent
from tests.conftest import free_port

RESULT: dict[str, Any] = {
    "method": "disaggregated",
    "ttft": 0.12,
    "tpot": 0.02,
    "prefill_time": 0.08,
    "queue_time": 0.001,
    "kv_transfer_time": 0.05,
    "kv_bytes": 300_000,
    "prompt_tokens": 40,
    "completion_tokens": 9,
    "cached_tokens": 32,
    "disk_cached_tokens": 16,
}


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict[str, Any], family: str, name: str, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no {name} {labels}")


def test_prometheus_text_parses_and_counts_what_happened() -> None:
    m = prom.GatewayMetrics(["m1"])
    before = families(m.text())
    # Every metric the dashboard may chart exists before any traffic, at zero.
    assert (
        sample(
            before, "disagg_gateway_fallbacks", "disagg_gateway_fallbacks_total", reason="timeout"
        )
        == 0
    )
    assert sample(before, "disagg_gateway_ttft_seconds", "disagg_gateway_ttft_seconds_count") == 0
    m.begin("m1")
    m.end("m1", Metrics.from_json(RESULT), "stop")
    m.begin("m1")
    m.end(
        "m1",
        Metrics.from_json(
            {
                **RESULT,
                "method": "local-fallback",
                "fallback_kind": "unreachable",
                "cached_tokens": 0,
            }
        ),
        "length",
    )
    m.begin("m1")
    m.end("m1", None, "error")
    m.agent("decode@x", "decode", "m1", up=False)
    f = families(m.text())
    assert (
        sample(f, "disagg_gateway_ttft_seconds", "disagg_gateway_ttft_seconds_count", model="m1")
        == 2
    )
    assert (
        sample(f, "disagg_gateway_ttft_seconds", "disagg_gateway_ttft_seconds_bucket", le="0.25")
        == 2
    )
    assert (
        sample(f, "disagg_gateway_ttft_seconds", "disagg_gateway_ttft_seconds_bucket", le="0.1")
        == 0
    )
    # K/V only for the request that moved K/V.
    assert sample(f, "disagg_gateway_kv_bytes", "disagg_gateway_kv_bytes_count") == 1
    assert sample(f, "disagg_gateway_kv_bytes", "disagg_gateway_kv_bytes_sum") == 300_000
    assert (
        sample(
            f, "disagg_gateway_fallbacks", "disagg_gateway_fallbacks_total", reason="unreachable"
        )
        == 1
    )
    assert sample(f, "disagg_gateway_prefix_hits", "disagg_gateway_prefix_hits_total") == 1
    assert sample(f, "disagg_gateway_cached_tokens", "disagg_gateway_cached_tokens_total") == 32
    disk = sample(f, "disagg_gateway_disk_cached_tokens", "disagg_gateway_disk_cached_tokens_total")
    assert disk == 16  # of the 32: the first request's disk hit
    assert (
        sample(f, "disagg_gateway_completion_tokens", "disagg_gateway_completion_tokens_total")
        == 18
    )
    errors = sample(f, "disagg_gateway_requests", "disagg_gateway_requests_total", outcome="error")
    assert errors == 1
    assert sample(f, "disagg_gateway_in_flight", "disagg_gateway_in_flight", model="m1") == 0
    assert sample(f, "disagg_gateway_agent_up", "disagg_gateway_agent_up", agent="decode@x") == 0
    names = {smp.name for fam in f.values() for smp in fam.samples}
    for metric in prom.METRICS:  # each documented name is exported, under its own name
        assert metric in names or f"{metric}_bucket" in names, metric


def test_fallback_kinds_are_the_agents() -> None:
    from disagg_agents.decode.kvfetch import FALLBACK_KINDS

    assert prom.FALLBACK_KINDS == FALLBACK_KINDS


def test_request_log_records_runs_and_failures() -> None:
    log = RequestLog(["m"])

    def run(model: str, request: dict[str, Any], on_token: Any = None) -> Any:
        if request.get("prompt") == "boom":
            raise RuntimeError("agent died")
        if request.get("prompt") == "stop":
            raise StopGeneration()
        on_token(TokenEvent(5, "hi"))
        return type("R", (), {"metrics": Metrics.from_json(RESULT)})()

    wrapped = log.wrap(run)
    wrapped(
        "m", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q?"}]}
    )
    with pytest.raises(RuntimeError):
        wrapped("m", {"prompt": "boom"})
    with pytest.raises(StopGeneration):
        wrapped("m", {"prompt": "stop"})
    rows = log.snapshot()
    assert [r["state"] for r in rows] == ["done", "failed", "done"]
    assert (
        rows[2]["prompt"] == "Q?" and rows[2]["tokens"] == 9 and rows[2]["first_token"] is not None
    )
    assert rows[1]["error"] == "agent died"
    assert prompt_of({"prompt": "x" * 500}).endswith("…")


def test_last_error_line_finds_the_crash(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text(
        "2026-11-23 10:00:00,001 decode INFO serving\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "RuntimeError: out of memory\n"
    )
    assert last_error_line(log) == "RuntimeError: out of memory"
    log.write_text("2026-11-23 10:00:00,001 decode ERROR generate failed\n2026 decode INFO ok\n")
    assert last_error_line(log) == "2026-11-23 10:00:00,001 decode ERROR generate failed"
    assert last_error_line(tmp_path / "missing.log") is None


def test_a_fleet_agents_crash_line_comes_from_the_file_changed_last(tmp_path: Path) -> None:
    err, log = tmp_path / "decode.stderr", tmp_path / "decode.log"
    err.write_text("Traceback (most recent call last):\n  File 'a.py'\nOSError: old crash\n")
    log.write_text("2026-11-23 10:00:00,001 decode ERROR generate failed: boom\n")
    cmd = crash_tail_command(str(err), str(log))

    def run() -> str | None:
        return last_error_from_tails(
            subprocess.run(["bash", "-c", cmd], capture_output=True, text=True).stdout
        )

    subprocess.run(["touch", "-d", "2020-01-01", str(err)], check=True)
    assert run() == "2026-11-23 10:00:00,001 decode ERROR generate failed: boom"
    subprocess.run(["touch", "-d", "2020-01-01", str(log)], check=True)
    subprocess.run(["touch", str(err)], check=True)  # the crash is the newest
    assert run() == "OSError: old crash"
    err.unlink()
    log.write_text("2026-11-23 10:00:00,001 decode INFO drained and stopped\n")
    assert run() is None  # stopped cleanly: nothing to show


def test_logs_read_stderr_and_place_the_crash_by_time(tmp_path: Path) -> None:
    paths = AgentPaths(str(tmp_path), "decode")
    (tmp_path / "logs").mkdir()
    Path(paths.log).write_text(
        "2020-01-01 10:00:00,000 decode INFO loaded\n2030-01-01 10:00:00,000 decode INFO later\n"
    )
    Path(paths.stderr).write_text("Traceback (most recent call last):\nMemoryError\n")
    # The crash happened in 2025: between the two log lines.
    subprocess.run(["touch", "-d", "2025-06-01 12:00:00", paths.stderr], check=True)
    out: queue.Queue[Any] = queue.Queue()
    for stream, cmd in log_commands(paths, 50, follow=False):
        done = subprocess.run(["bash", "-c", cmd], capture_output=True, check=False)
        pump_lines("h", "decode", iter(done.stdout.splitlines(keepends=True)), out, stream)
    got: list[LogLine] = []
    while not out.empty():
        got.append(out.get())
    merged = [(line.stream, line.text) for line in merge_by_time(got)]
    assert merged == [
        ("log", "2020-01-01 10:00:00,000 decode INFO loaded"),
        ("stderr", "Traceback (most recent call last):"),
        ("stderr", "MemoryError"),
        ("log", "2030-01-01 10:00:00,000 decode INFO later"),
    ]
    # No stderr file: nothing from it, and no error.
    Path(paths.stderr).unlink()
    cmd = dict(log_commands(paths, 50, follow=False))["stderr"]
    assert subprocess.run(["bash", "-c", cmd], capture_output=True).stdout == b""


# ---- the sign-in, through the real guard, on a real socket ---------------------------

KEY = "sesame-" + "k" * 20


@pytest.fixture(scope="module")
def dead_gateway() -> Iterator[str]:
    """The gateway with an API key over one pipeline whose agents are not running."""
    dead = free_port()
    prefill = [Endpoint("prefill@dead", "127.0.0.1", dead, dead)]
    # An inventory alias is a second route over the same agents.
    routes = [Route("m", prefill, []), Route("m-alias", prefill, [])]
    app = create_app(Client(router=Router(routes)), api_key=KEY)
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
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a: Any, **k: Any) -> None:
        return None


def get(
    url: str, headers: dict[str, str] | None = None, data: bytes | None = None
) -> tuple[int, dict[str, str], str]:
    opener = urllib.request.build_opener(NoRedirect)
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_key_in_the_address_sets_a_strict_cookie_and_leaves(dead_gateway: str) -> None:
    status, headers, body = get(f"{dead_gateway}/ui")
    assert status == 200 and 'name="key"' in body and "prefill@dead" not in body
    assert get(f"{dead_gateway}/ui/api/state")[0] == 401
    status, headers, _ = get(f"{dead_gateway}/ui?key={KEY}")
    assert status == 303 and headers["location"] == "/ui"  # the key leaves the address bar
    cookie = headers["set-cookie"]
    attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
    assert attrs == {"path", "httponly", "samesite"} and "SameSite=Strict" in cookie
    assert "Path=/ui" in cookie and KEY not in cookie  # no Domain: this host only
    jar = cookie.split(";")[0]
    status, _, raw = get(f"{dead_gateway}/ui/api/state", {"Cookie": jar})
    state = json.loads(raw)
    assert status == 200 and state["models"] == ["m"]  # the alias is not a second pipeline
    (agent,) = state["agents"]
    assert agent["name"] == "prefill@dead" and agent["up"] is False and agent["error"]
    # Polled every second: gzip when the browser takes it, the same JSON inside.
    req = urllib.request.Request(
        f"{dead_gateway}/ui/api/state", headers={"Cookie": jar, "Accept-Encoding": "gzip"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert json.loads(gzip.decompress(r.read()))["models"] == ["m"]
    # The cookie opens the view's data, never the model APIs or the metrics.
    assert get(f"{dead_gateway}/v1/models", {"Cookie": jar})[0] == 401
    assert get(f"{dead_gateway}/metrics", {"Cookie": jar})[0] == 401
    assert get(f"{dead_gateway}/metrics", {"Authorization": f"Bearer {KEY}"})[0] == 200
    # A forged or stale cookie is refused.
    assert get(f"{dead_gateway}/ui/api/state", {"Cookie": f"{auth.COOKIE}=00"})[0] == 401


def test_key_form_posts_and_a_wrong_key_is_told(dead_gateway: str) -> None:
    status, _, body = get(f"{dead_gateway}/ui/login", data=b"key=wrong")
    assert status == 401 and "not the gateway" in body and "prefill@dead" not in body
    status, headers, _ = get(f"{dead_gateway}/ui/login", data=f"key={KEY}".encode())
    assert status == 303 and headers["set-cookie"].startswith(f"{auth.COOKIE}=")


def test_page_and_assets_are_local_and_locked_down(dead_gateway: str) -> None:
    status, headers, _ = get(f"{dead_gateway}/ui?key={KEY}")
    jar = headers["set-cookie"].split(";")[0]
    status, headers, page = get(f"{dead_gateway}/ui", {"Cookie": jar})
    assert status == 200 and "/ui/assets/ui.js" in page
    assert "default-src 'self'" in headers["content-security-policy"]
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    for name in ("ui.js", "ui.css", "favicon.svg"):
        status, _, text = get(f"{dead_gateway}/ui/assets/{name}")
        assert status == 200 and "https://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert get(f"{dead_gateway}/ui/assets/..%2Fauth.py")[0] == 404

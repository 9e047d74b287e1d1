"""Fast unit tests of small pure parts: stop sequences, service files, ProxyJump
chains, the Prometheus text. No agents, no models, no network."""

from __future__ import annotations

import plistlib
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from disagg.fleet.inventory import SshSettings
from disagg.fleet.service import AgentPaths, launchd_plist, systemd_unit
from disagg.fleet.ssh import _parse_jump, resolve
from disagg.serving.stops import StopMatcher
from disagg_agents.runtime.metrics import Stats


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[str, str, bool]:
    m = StopMatcher(stops)
    shown = ""
    for piece in pieces:
        shown += m.feed(piece)
        if m.hit:
            break
    if not m.hit:
        shown += m.flush()
    return shown, m.text, m.hit


def reference(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """The text as far as it had arrived when a stop string first appeared in it,
    cut at the earliest place any stop begins there (decoding ends at that piece:
    a longer stop that began earlier never gets to finish)."""
    text = ""
    for piece in pieces:
        text += piece
        ats = [at for s in stops if s and (at := text.find(s)) >= 0]
        if ats:
            return text[: min(ats)], True
    return text, False


@settings(max_examples=400, deadline=None)
@example(pieces=["\nb", "b"], stops=["b", "\nbb"])  # "b" ends it before "\nbb" can finish
@given(
    pieces=st.lists(st.text(alphabet="ab\nc", max_size=4), max_size=30),
    stops=st.lists(st.text(alphabet="abc\n", max_size=4), max_size=4),
)
def test_stop_matcher_equals_cutting_the_text_at_the_first_stop(
    pieces: list[str], stops: list[str]
) -> None:
    # Shown text = the text cut at the first stop; nothing shown is ever taken back.
    shown, kept, hit = run_matcher(pieces, stops)
    want, want_hit = reference(pieces, stops)
    assert (shown, kept, hit) == (want, want, want_hit)


def test_stop_matcher_holds_back_only_a_possible_stop() -> None:
    m = StopMatcher(["</answer>"])
    # The last len(stop) - 1 = 8 characters are held: they could begin a stop.
    assert m.feed("Paris") == ""
    assert m.feed(" is the capital") == "Paris is the"
    assert m.feed("</ans") == " capi"
    assert m.feed("wer> trailing") == "tal" and m.hit
    assert m.feed("more") == ""  # after a stop nothing more is shown
    assert m.text == "Paris is the capital"


def test_systemd_unit_runs_the_agent_script() -> None:
    paths = AgentPaths("/home/ops/disagg", "decode")
    unit = systemd_unit(paths)
    assert re.search(r"^ExecStart=/bin/sh .*/home/ops/disagg/decode\.sh", unit, re.M)
    assert "[Service]" in unit and "WantedBy=default.target" in unit


def test_launchd_plist_is_valid_and_runs_the_agent_script() -> None:
    paths = AgentPaths("/Users/ops/disagg", "prefill")
    plist = plistlib.loads(launchd_plist(paths).encode())
    assert plist["ProgramArguments"] == ["/bin/sh", "/Users/ops/disagg/prefill.sh"]
    assert plist["Label"] == paths.label and plist["RunAtLoad"] is False


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("bastion", (None, "bastion", None)),
        ("ops@bastion", ("ops", "bastion", None)),
        ("ops@bastion:2222", ("ops", "bastion", 2222)),
        ("bastion:2200", (None, "bastion", 2200)),
    ],
)
def test_proxyjump_hop_parsing(spec: str, parsed: tuple[str | None, str, int | None]) -> None:
    assert _parse_jump(spec) == parsed


def test_proxyjump_chain_from_ssh_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config"
    cfg.write_text(
        "Host mac\n  HostName 10.9.0.5\n  User studio\n  ProxyJump ops@gate:2222,inner\n"
        "Host inner\n  HostName 10.9.0.1\n  Port 2200\n"
    )
    target = resolve("mac", SshSettings(config=str(cfg)))
    assert (target.hostname, target.user, target.port) == ("10.9.0.5", "studio", 22)
    # "a,b": b is reached through a, so the direct jump is inner, and inner's is gate.
    assert target.jump is not None and target.jump.hostname == "10.9.0.1"
    assert target.jump.port == 2200
    gate = target.jump.jump
    assert gate is not None and (gate.hostname, gate.user, gate.port) == ("gate", "ops", 2222)
    assert gate.jump is None


def test_proxyjump_loop_is_refused(tmp_path: Path) -> None:
    from disagg.errors import ConnectError

    cfg = tmp_path / "config"
    cfg.write_text("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    with pytest.raises(ConnectError, match="too deep"):
        resolve("a", SshSettings(config=str(cfg)))


def test_prometheus_text_is_well_formed() -> None:
    stats = Stats("decode")
    stats.begin()
    stats.end("ok", {"method": "disaggregated", "ttft": 0.2, "tpot": 0.01, "kv_bytes": 1000})
    stats.begin()
    fell_back = {"method": "local-fallback", "fallback_kind": "timeout", "queue_time": 0.03}
    stats.end("ok", fell_back)
    stats.begin()
    stats.end("bad_request", {})
    text = stats.prometheus()
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# TYPE ") or sample.match(line), line
    assert 'disagg_requests_total{role="decode",method="disaggregated",outcome="ok"} 1' in text
    assert 'disagg_fallbacks_total{role="decode",reason="timeout"} 1' in text
    assert 'disagg_queue_seconds_bucket{le="0.05"} 1' in text
    assert 'disagg_queue_seconds_bucket{le="0.025"} 0' in text
    assert 'disagg_kv_request_bytes_bucket{le="1024"} 1' in text  # exact bounds, not 1.02e+03
    assert 'outcome="bad_request"} 1' in text
    assert "disagg_kv_bytes_total 1000" in text
    assert (
        'disagg_ttft_seconds_bucket{le="+Inf"} 1' in text and "disagg_ttft_seconds_count 1" in text
    )
    # Buckets are cumulative: counts never fall as le grows.
    counts = [int(n) for n in re.findall(r'disagg_ttft_seconds_bucket\{le="[^"]+"\} (\d+)', text)]
    assert counts == sorted(counts) and counts[-1] == 1


def test_a_drain_a_signal_began_exits_as_that_signal() -> None:
    """Once uvicorn has drained and returned, `disagg serve` leaves as the signal
    would (Ctrl-C: 130 through the CLI's KeyboardInterrupt; SIGTERM: 143), whether
    or not uvicorn's own re-raise of it got through."""
    import signal

    import uvicorn

    from disagg.frontends.shutdown import Drain, DrainingServer

    drain = Drain(lambda: 0, lambda: None, lambda: None)
    server = DrainingServer(uvicorn.Config(app="unused:app"), drain)
    server.exit_as_signalled()  # no signal: a plain return
    server.signalled = signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        server.exit_as_signalled()
    server.signalled = signal.SIGTERM
    with pytest.raises(SystemExit) as done:
        server.exit_as_signalled()
    assert done.value.code == 128 + signal.SIGTERM

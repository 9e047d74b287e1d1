"""Remote strings on the operator's terminal. One hostile /status must not hide
the fleet (`disagg status`, run in this process, against a fake agent's control
port); remote stderr, log tails and reasons with rich markup or
terminal escapes render as plain text in every table (a colour terminal, so a
live hyperlink would show as OSC 8)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console, RenderableType

from disagg.cli.render import batch_table, metrics_table
from disagg.cli.render_fleet import actions_table, deploy_table, log_line, status_table
from disagg.fleet.deploy import HostDeploy
from disagg.fleet.operations import AgentAction, HostProbe, LogLine
from disagg.fleet.ssh import HostResult
from disagg.serving.metrics import Metrics
from disagg_agents.wire.status import AgentStatus
from tests.conftest import Cli
from tests.hostile.test_fleet_answers import FakeAgent, inventory

EVIL = "\x1b[2J\x1b]0;pwned\x07[link=http://evil.example]click[/link] [/] [bold red]x"


def shown(renderable: RenderableType) -> str:
    out = io.StringIO()
    Console(file=out, width=300, force_terminal=True, color_system="truecolor").print(renderable)
    return out.getvalue()


def plain_and_safe(text: str) -> None:
    assert "\x1b]8;" not in text  # no hyperlink
    assert "\x1b[2J" not in text and "\x1b]0;" not in text and "\x07" not in text
    assert "[link=http://evil.example]click[/link]" in text  # the brackets, as text


def test_one_hostile_status_costs_its_row_only(tmp_path: Path, cli: Cli) -> None:
    fake = FakeAgent()
    fake.body = json.dumps(
        {"model": "m", "backend": "mlx", "requests": 3, "prefix_cache": {"bytes": "x"}}
    ).encode()
    try:
        env = {"DISAGG_TOKEN_FILE": str(tmp_path / "no-token")}
        proc = cli("status", "-i", str(inventory(tmp_path, fake.port)), env=env)
    finally:
        fake.close()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1
    # The table is there: the prefill row (nothing answers it) and the hostile one.
    assert "prefill" in proc.stdout and "decode" in proc.stdout, proc.stdout
    # The hostile row names its field; the prefill row (nothing answers) is there.
    assert "bad answer" in proc.stdout and "prefix_cache.bytes" in proc.stdout, proc.stdout
    assert "unreachable" in proc.stdout, proc.stdout


def test_status_rows_render_each_in_its_own_guard() -> None:
    good = HostProbe(
        "a", "prefill", "healthy", "1.2.3.4:1", AgentStatus.from_json({"model": "m", "requests": 5})
    )
    hostile = {"prefix_cache": {"hit_rate": "x"}, "uptime_s": "\x1b[2J"}
    bad = HostProbe("b", "decode", "healthy", "1.2.3.4:2", AgentStatus.from_json(hostile))
    assert good.ok and not bad.ok
    for width in (300, 80):  # the wide table and the narrow one
        out = io.StringIO()
        Console(file=out, width=width, color_system=None).print(status_table([good, bad], width))
        text = out.getvalue()
        assert "prefill" in text and "bad answer" in text, text
        assert "prefix_cache.hit_rate" in text and "uptime_s" in text, text
        assert "\x1b" not in text, text


def test_remote_text_in_fleet_tables_is_plain() -> None:
    deployed = HostDeploy("h", platform=EVIL, python="py", notes=[EVIL])
    plain_and_safe(shown(deploy_table([HostResult("h", deployed), HostResult("g", None, EVIL)])))
    action = AgentAction("h", "decode", "started", f"log tail:\n{EVIL}")
    plain_and_safe(
        shown(actions_table([HostResult("h", [action]), HostResult("g", None, EVIL)], "start"))
    )
    plain_and_safe(shown(log_line(LogLine("h", "", f"error: {EVIL}", error=True), 10)))


def test_reasons_and_errors_in_result_tables_are_plain() -> None:
    plain_and_safe(shown(metrics_table(Metrics(method="local-fallback", fallback_reason=EVIL))))
    rows = [{"id": 1, "error": EVIL}, {"id": 2, "text": EVIL, "metrics": {"method": EVIL}}]
    summary = {"requests": 2, "failed": 1, "wall_time": 1.0, "sum_time": 1.0}
    text = shown(batch_table(rows, summary))
    assert "\x1b]8;" not in text and "\x1b[2J" not in text and "[link=" in text

"""The README's and docs/api.md's examples, copied as a new user would, run against
`disagg serve`'s app over the embedded default's agents (what `disagg serve
--local` serves), with DISAGG_API_KEY set as the README says: every shell command
that talks to the gateway (curl, `disagg status --url`) and the README's Python
client snippets. The commands that start servers or need a cluster are not run
here; the gateway started by the test stands in for `disagg serve --local &`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agentpool import AgentSet
from tests.gateways import Gateways

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs/api.md")
KEY = "readme-test-key-0123456789abcdef"
PORT = "http://127.0.0.1:8080"


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M)


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def gateway_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in blocks(path, "bash"):
            for cmd in commands(block):
                if cmd.startswith(("curl ", "disagg status --url")):
                    found.append((path.name, cmd))
    return found


def test_the_docs_hold_runnable_gateway_commands() -> None:
    cmds = [c for _, c in gateway_commands()]
    assert any("/api/generate" in c for c in cmds) and any("/v1/messages" in c for c in cmds)
    assert any(c.startswith("disagg status --url") for c in cmds)
    readme = (ROOT / "README.md").read_text()
    for api in ("/v1/responses", "/v1/messages", "/api", "/v1/chat/completions"):
        assert api in readme, api  # all four APIs named
    assert "export DISAGG_API_KEY" in readme  # the key step


@pytest.fixture(scope="module")
def url(smol_set: AgentSet, gateways: Gateways, default_model: Path) -> str:
    assert default_model.name == "SmolLM2-135M-Instruct"  # the name the docs use
    return gateways.get({default_model.name: smol_set}, api_keys=[KEY]).url


def run(cmd: str, url: str) -> subprocess.CompletedProcess[str]:
    cmd = cmd.replace(PORT, url)
    if cmd.startswith("disagg "):
        cmd = f"{sys.executable} -m disagg.cli " + cmd.removeprefix("disagg ")
    env = {**os.environ, "DISAGG_API_KEY": KEY, "COLUMNS": "120"}
    return subprocess.run(
        ["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.parametrize(("doc", "cmd"), gateway_commands(), ids=lambda v: str(v)[:60])
def test_a_shell_example_runs_as_written(url: str, doc: str, cmd: str) -> None:
    done = run(cmd, url)
    assert done.returncode == 0, (doc, cmd, done.stdout, done.stderr)
    if cmd.startswith("curl "):
        body = json.loads(done.stdout)
        assert not body.get("error") and body.get("type") != "error", (doc, cmd, body)
    else:
        assert "SmolLM2-135M-Instruct" in done.stdout and " up " in done.stdout, done.stdout


@pytest.mark.parametrize("i", range(len([b for b in blocks(DOCS[0], "python") if PORT in b])))
def test_a_readme_client_snippet_runs_as_written(url: str, i: int) -> None:
    code = [b for b in blocks(DOCS[0], "python") if PORT in b][i]
    done = subprocess.run(
        [sys.executable, "-c", code.replace(PORT, url)],
        env={**os.environ, "DISAGG_API_KEY": KEY},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (code, done.stderr)
    assert done.stdout.strip(), code

"""The real agent CLIs from npm, one headless turn each against `disagg serve`'s
app over real agents: OpenAI's Codex (`codex exec`, a custom provider on /v1/responses) and
Anthropic's Claude Code (`claude -p`, ANTHROPIC_BASE_URL at the gateway).

Codex runs on the embedded default, SmolLM2, the model a new user gets: its template
takes no tools, so they go through the generic format (described in the system
prompt, the answer a grammar-held JSON call or reply). Claude Code's own prompt
(~20k tokens of tools and agents) is past SmolLM2's 8k context: it must show that
error whole; on a tiny random qwen3-coder whose context holds it, it completes a turn.
A second Claude Code session finds its prompt in the prefix cache: the billing
header's per-request nonce stays out of the cache key.

`.ci/run` installs the CLIs into .ci/node (npm, pinned versions); elsewhere set
DISAGG_AGENT_CLIS to a node_modules/.bin holding `codex` and `claude`. Without them
the tests skip, except under CI=true, where a missing CLI is a failure."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agentpool import AgentSet
from tests.conftest import PairFactory
from tests.gateways import Gateway, Gateways
from tests.tinymodels import shared_tiny

pytestmark = pytest.mark.slow

BIN = Path(
    os.environ.get(
        "DISAGG_AGENT_CLIS", Path(__file__).resolve().parent.parent / ".ci/node/node_modules/.bin"
    )
)
HAVE_CLIS = (BIN / "codex").exists() and (BIN / "claude").exists()
# CI installs them: there, a missing CLI fails the test instead of skipping it.
needs_clis = pytest.mark.skipif(
    not HAVE_CLIS and os.environ.get("CI", "").lower() != "true",
    reason=f"no codex and claude in {BIN} (.ci/run installs them with npm)",
)
QUIET = {  # nothing but the gateway: no telemetry, updates or login checks
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}


@pytest.fixture(scope="module")
def served(agent_pair: PairFactory, gateways: Gateways) -> tuple[str, str, Gateway]:
    """(base URL, model name, gateway): `disagg serve`'s app in this process over the
    pooled agents of the tiny qwen3-coder."""
    model = "tiny-qwen3-coder"
    gateway = gateways.get({model: agent_pair.set(shared_tiny("qwen3_coder"))})
    return gateway.url, model, gateway


@pytest.fixture(scope="module")
def smol(smol_set: AgentSet, gateways: Gateways, default_model: Path) -> tuple[str, str, Gateway]:
    """(base URL, model name, gateway) over the embedded default's pooled agents."""
    gateway = gateways.get({default_model.name: smol_set})
    return gateway.url, default_model.name, gateway


def run(
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float = 300,
    give_up: Callable[[], bool] = lambda: False,
) -> tuple[int, str]:
    """(exit code, what it printed); a session past `timeout`, or for which `give_up()`
    turns true (asked twice a second), is killed, with every process it started (the
    shells of its tool calls hold its output open: killing the CLI alone left a looping
    Codex session running for minutes): rc -9."""
    assert HAVE_CLIS, f"no codex and claude in {BIN}: CI=true wants them (npm, see .ci/run)"
    with subprocess.Popen(
        cmd,
        env={**os.environ, **QUIET, **env},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, to kill whole
    ) as p:
        deadline = time.monotonic() + timeout
        while True:
            try:  # retried after a timeout, communicate loses no output
                out, _ = p.communicate(timeout=0.5)
                return p.returncode, out
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline or give_up():
                    os.killpg(p.pid, signal.SIGKILL)
                    out, _ = p.communicate()
                    return -9, out


def codex_home(tmp_path: Path, url: str, model: str) -> Path:
    """A CODEX_HOME whose config points Codex at the gateway's Responses API."""
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "disagg"\n'
        f'[model_providers.disagg]\nname = "disagg"\nbase_url = "{url}/v1"\n'
        'wire_api = "responses"\nenv_key = "DISAGG_KEY"\n'
    )
    return home


def finishes_logged(gateway: Gateway, since: int) -> list[str]:
    """The finish reason of each request the gateways logged from mark `since` on
    (stop, length, tool_calls)."""
    return re.findall(r" request \d+ \S+ (\w+) \S+: \d+ prompt", gateway.log(since))


def requests_logged(gateway: Gateway, since: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached) of each request the gateways logged from mark `since` on."""
    pattern = r" request \d+ .* (\d+) prompt \((\d+) cached\)"
    return [(int(a), int(b)) for a, b in re.findall(pattern, gateway.log(since))]


@needs_clis
def test_codex_exec_runs_a_turn_over_the_responses_api(
    served: tuple[str, str, Gateway], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the tiny qwen3-coder, whose template takes tools (its own format, not the
    generic one the embedded default's turn below goes through)."""
    from disagg.frontends import maxtokens

    # Codex sends no limit: the operator's default (`serve --max-tokens 32`) holds the
    # random model's answer, which would otherwise run to its 131k context.
    monkeypatch.setattr(maxtokens, "_operator_default", 32)
    url, model, log = served
    home = codex_home(tmp_path, url, model)
    mark = log.log_mark()
    rc, said = run(
        [str(BIN / "codex"), "exec", "--skip-git-repo-check", "Say hi."],
        {"CODEX_HOME": str(home), "DISAGG_KEY": "unused"},
        tmp_path,
    )
    assert "Reconnecting" not in said, said  # never a stream that fails after its start
    # The random model stops where it happens to write its end token, or at the limit.
    cut = "Incomplete response returned, reason: max_output_tokens" in said
    assert cut or rc == 0, said
    assert "tokens used" in said, said  # it read the usage of the final event
    seen = requests_logged(log, mark)
    assert seen and seen[0][0] > 1000, seen  # Codex's own prompt and tools, rendered


API_MD = Path(__file__).resolve().parent.parent / "docs/api.md"
DOC_URL = "http://127.0.0.1:8080"


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def documented_codex() -> tuple[str, str, list[str]]:
    """docs/api.md's Codex recipe: (config.toml, model catalog, `codex exec` lines)."""
    text = API_MD.read_text()
    config = next(b for b in fenced(text, "toml") if 'model_provider = "disagg"' in b)
    catalog = next(b for b in fenced(text, "json") if '"models"' in b)
    lines = [ln.strip() for b in fenced(text, "bash") for ln in b.splitlines()]
    return config, catalog, [ln for ln in lines if ln.startswith("codex exec ")]


def documented_codex_home(tmp_path: Path, url: str) -> Path:
    """A CODEX_HOME holding the documented config (its URL the gateway's) and catalog,
    under the name the config gives it."""
    config, catalog, _ = documented_codex()
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(config.replace(DOC_URL, url))
    name = re.search(r'^model_catalog_json = "([^"]+)"', config, re.M)
    assert name, config
    (home / name.group(1)).write_text(catalog)
    return home


def test_the_docs_hold_the_codex_recipe() -> None:
    config, catalog, cmds = documented_codex()
    assert DOC_URL + "/v1" in config and json.loads(catalog)["models"]
    assert len(cmds) >= 2 and all("--skip-git-repo-check" in c for c in cmds), cmds
    assert any("--sandbox workspace-write" in c for c in cmds), cmds


# Codex's turn on SmolLM2: the prompt asks for a plain reply (the model may still call
# a tool: it is on). A 135M model at Codex's temperature 1 completes about half of its
# sessions; the rest run to the operator's length or call tools in a loop. So a session
# may be retried, and every session must end cleanly; one already lost is cut at once
# (an answer cut at the limit: Codex errors and retries; a second tool call: a loop,
# none of which was seen to end in a reply). With the documented catalog Codex's prompt
# is ~2.4k tokens (~6.4k without); the first session prefills it, later ones find it
# cached and reply in ~5-12 s. Sessions complete ~30-50 % of the time, so twelve tries
# (0.7^12 ~ 1.4 %) leave a lost run to chance alone.
CODEX_SESSIONS = 12
CODEX_LIMIT = 64  # `serve --max-tokens`: a run-on answer is cut in ~15 s
CODEX_FIRST_S = 75  # the first session prefills Codex's prompt
CODEX_SESSION_S = 40  # later ones find it cached; a tool loop is cut after ~3 calls


def codex_session(
    cmd: str, home: Path, log: Gateway, cwd: Path, timeout: float
) -> tuple[int, list[str], str]:
    """One documented `codex exec` line, run as written in `cwd`: (exit code, finish
    reasons logged, what it said); one already lost is cut."""
    mark = log.log_mark()

    def lost() -> bool:
        ends = finishes_logged(log, mark)
        return "length" in ends or ends.count("tool_calls") >= 2

    argv = [str(BIN / "codex"), *shlex.split(cmd)[1:]]
    rc, said = run(argv, {"CODEX_HOME": str(home), "DISAGG_API_KEY": "unused"}, cwd, timeout, lost)
    seen = requests_logged(log, mark)
    # Never a stream that fails after its start, nor a refusal of the directory; Codex
    # knew the model (the catalog) and sent its instructions and tools.
    assert "Reconnecting" not in said and "server_error" not in said, said
    assert "trusted directory" not in said and "Model metadata" not in said, said
    # (A request given up before its prompt was prefilled logs 0 tokens: seen under
    # load, Codex then sent it again.)
    assert seen and max(tokens for tokens, _ in seen) > 1500, seen
    return rc, finishes_logged(log, mark), said


def not_a_git_repo(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir(parents=True)
    inside = subprocess.run(["git", "-C", str(work), "rev-parse"], capture_output=True)
    assert inside.returncode != 0, f"{work} is inside a git repository"
    return work


@needs_clis
def test_codex_documented_turn_completes_outside_a_git_repo_on_the_embedded_default(
    smol: tuple[str, str, Gateway], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from disagg.frontends import maxtokens

    monkeypatch.setattr(maxtokens, "_operator_default", CODEX_LIMIT)
    url, model, log = smol
    home = documented_codex_home(tmp_path, url)
    cmd = documented_codex()[2][0]
    assert model in (home / "config.toml").read_text()  # the docs name the served model
    sessions = []
    for i in range(CODEX_SESSIONS):
        work = not_a_git_repo(tmp_path / f"s{i}")
        timeout = CODEX_SESSION_S if i else CODEX_FIRST_S
        rc, ends, said = codex_session(cmd, home, log, work, timeout)
        sessions.append((rc, ends, said[-300:]))
        if rc == 0:
            assert "tokens used" in said, said  # it read the final event's usage
            break
    print(f"codex sessions (exit code, finishes): {[(rc, ends) for rc, ends, _ in sessions]}")
    assert sessions[-1][0] == 0, sessions


@needs_clis
def test_codex_documented_writing_task_runs_outside_a_git_repo(
    smol: tuple[str, str, Gateway], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writing line runs in a sandbox that may write (Codex says so) and reaches
    the model; SmolLM2 itself is not held to writing the file."""
    from disagg.frontends import maxtokens

    monkeypatch.setattr(maxtokens, "_operator_default", CODEX_LIMIT)
    url, _, log = smol
    home = documented_codex_home(tmp_path, url)
    cmd = next(c for c in documented_codex()[2] if "workspace-write" in c)
    rc, ends, said = codex_session(cmd, home, log, not_a_git_repo(tmp_path), CODEX_FIRST_S)
    print(f"codex writing task: exit code {rc}, finishes {ends}")
    assert "sandbox: workspace-write" in said, said
    # Ended; or cut once lost; or, when the reply ran to the limit, Codex gave up on it
    # itself before the cut (exit 1 on our `incomplete` / `max_output_tokens`, as it should).
    ran_long = rc == 1 and "length" in ends and "reason: max_output_tokens" in said
    assert (rc in (0, -9) or ran_long) and ends, (rc, ends, said[-300:])


@needs_clis
def test_claude_code_shows_the_context_error_on_the_embedded_default(
    smol: tuple[str, str, Gateway], tmp_path: Path
) -> None:
    url, model, _ = smol
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "HOME": str(tmp_path),
    }
    rc, said = run([str(BIN / "claude"), "-p", "Say hi.", "--model", model], env, tmp_path)
    assert rc != 0
    # Its own words around ours, whole: the prompt's length and the model's context.
    assert re.search(r"API Error: 400 .*the prompt is \d+ tokens.* context is 8192", said), said


# The random model runs to the limit, and Claude Code then asks it three more times to
# go on: each session is four requests of this many tokens (at 32: 192 more decoded).
CLAUDE_LIMIT = 8


@needs_clis
def test_claude_code_runs_a_turn_over_the_messages_api(
    served: tuple[str, str, Gateway], tmp_path: Path
) -> None:
    url, model, log = served
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_LIMIT),
        "HOME": str(tmp_path),
    }
    turns = []
    for _ in range(2):
        mark = log.log_mark()
        rc, said = run([str(BIN / "claude"), "-p", "Say hi.", "--model", model], env, tmp_path)
        # The random model stops where it writes its end token (rc 0, its text), or
        # Claude Code's words for a message that ended on stop_reason max_tokens.
        cut = f"exceeded the {CLAUDE_LIMIT} output token maximum" in said
        assert cut or (rc == 0 and "API Error" not in said and said.strip()), said
        turns.append(requests_logged(log, mark))
    first, second = turns[0][0], turns[1][0]
    assert first[0] > 10_000, turns  # its system prompt, tools and agents
    # The second session's prompt is found in the cache: the nonce stays out of the key.
    assert second[1] >= 0.9 * second[0], turns

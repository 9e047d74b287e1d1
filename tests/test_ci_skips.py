"""Under CI=true a skip for want of something CI provides fails (tests/conftest.py):
the hook itself, on reports as pytest makes them."""

from __future__ import annotations

from typing import Any

import pytest

from tests import conftest


def skipped(reason: str) -> pytest.TestReport:
    where = ("tests/test_x.py", 1, f"Skipped: {reason}")
    return pytest.TestReport(
        "tests/test_x.py::t", where[:2] + ("t",), {}, "skipped", where, "setup"
    )


def through_hook(report: pytest.TestReport) -> pytest.TestReport:
    hook: Any = conftest.pytest_runtest_makereport
    gen = hook(None, None)
    next(gen)
    try:
        gen.send(report)
    except StopIteration as stop:
        out: pytest.TestReport = stop.value
        return out
    raise AssertionError("the hook yielded twice")


@pytest.mark.parametrize(
    "reason",
    [
        "no codex and claude in /x/.bin (.ci/run installs them with npm)",
        "needs Debian's headless chromium and its driver: apt-get install chromium "
        "chromium-driver (CI installs both)",
        "could not import 'openai_harmony': No module named 'openai_harmony'",
        "the test bed needs root: network namespaces, users, sshd",
        "no system OpenBLAS here (Debian: libopenblas0-pthread; .ci/run installs it)",
    ],
)
def test_under_ci_a_skip_for_what_ci_provides_fails(
    reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    out = through_hook(skipped(reason))
    assert out.outcome == "failed" and reason in str(out.longrepr)
    monkeypatch.delenv("CI")
    assert through_hook(skipped(reason)).outcome == "skipped"  # off CI: a skip


def test_under_ci_a_skip_for_what_ci_lacks_stays_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert through_hook(skipped("needs a CUDA device")).outcome == "skipped"

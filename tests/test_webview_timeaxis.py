"""The web view's request list on one time axis, in headless chromium against a real
`disagg serve --local`: a longer request has a longer bar, a cancelled stream is
marked cancelled, a 404 is listed. With DISAGG_UI_SHOTS=DIR the page is saved as
DIR/ui-timeaxis.png."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.test_webview_live import (
    MODEL,
    agents_on_page,
    browser,  # noqa: F401  (the fixture)
    needs_browser,
    wait_for,
)

pytestmark = [pytest.mark.slow, needs_browser]


def serve_on_a_quiet_port(args: tuple[str, ...], log: Path) -> tuple[Any, str]:
    """`disagg serve --local ARGS` as a process; once its port answers, make sure it
    is this process that answers (its web view's page), not another one."""
    cmd = [sys.executable, "-m", "disagg.cli", "serve", "--local", *args]
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"disagg serve did not start:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/ui", timeout=5) as r:
                if b"/ui/assets/ui.css" in r.read():
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)


@pytest.fixture(scope="module")
def url(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, address = serve_on_a_quiet_port((), tmp_path_factory.mktemp("axis") / "serve.log")
    yield address
    proc.terminate()
    proc.wait(120)


ROWS_JS = """
return [...document.querySelectorAll('.req[data-req]')].map((r) => {
  const span = r.querySelector('.bar i.span');
  return {
    text: r.innerText, outcome: r.dataset.outcome,
    width: span ? span.getBoundingClientRect().width : null,
    seconds: span ? parseFloat(span.dataset.width) : null,
    cancelled_mark: !!r.querySelector('.bar i.end.cancelled'),
  };
});
"""


def test_bars_share_a_time_axis_and_ends_are_marked(url: str, browser: Any) -> None:  # noqa: F811
    browser.get(f"{url}/ui")
    wait_for(lambda: agents_on_page(browser), 60, "page did not load")
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    tag = f"{time.time():.0f}"
    for n in (2, 24):  # a short and a long request, one after the other
        oai.completions.create(
            model=MODEL, prompt=f"Count to one hundred: one, two, ({tag}/{n})", max_tokens=n
        )
    body = {
        "model": MODEL,
        "prompt": f"Tell me a long story about the sea. ({tag})",
        "options": {"num_predict": 2000, "temperature": 0.8, "seed": 2},
    }
    with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=900) as r:
        lines = r.iter_lines()
        for _ in range(4):  # some tokens, then hang up
            assert json.loads(next(lines))["done"] is False
    assert httpx.get(f"{url}/v1/no-such-route-{tag}", timeout=30).status_code == 404

    def rows() -> list[dict[str, Any]]:
        # one read of the page: it redraws every second, so elements go stale
        return list(browser.execute_script(ROWS_JS))

    def found() -> dict[str, dict[str, Any]] | None:
        got = {}
        for name, text, outcome in (
            ("short", f"({tag}/2)", None),
            ("long", f"({tag}/24)", None),
            ("cut", f"sea. ({tag})", "cancelled"),
            ("gone", f"no-such-route-{tag}", "refused"),
        ):
            row = next(
                (r for r in rows() if text in r["text"] and outcome in (None, r["outcome"])), None
            )
            if row is None:
                return None
            got[name] = row
        return got

    got = wait_for(found, 60, "a request is missing from the page")
    assert "cancelled" in got["cut"]["text"] and got["cut"]["cancelled_mark"], got["cut"]
    assert "404" in got["gone"]["text"], got["gone"]
    short, long = got["short"], got["long"]
    # One axis: widths in proportion to durations (within rounding and a minimum width);
    # which one took longer is this loaded box's business.
    assert short["seconds"] != long["seconds"] and short["width"] != long["width"], got
    ratio = (long["width"] / short["width"]) / (long["seconds"] / short["seconds"])
    assert 0.5 < ratio < 2.0, got
    out = os.environ.get("DISAGG_UI_SHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "ui-timeaxis.png").write_bytes(browser.get_screenshot_as_png())

"""The web view's request list on one time axis, in headless chromium against a real
`disagg serve --local`: a longer request has a longer bar, a cancelled stream is
marked cancelled, a 404 is listed. With DISAGG_UI_SHOTS=DIR the page is saved as
DIR/ui-timeaxis.png."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.test_webview_live import (
    MODEL,
    agents_on_page,
    browser,  # noqa: F401  (the fixture)
    needs_browser,
    serve_on_a_quiet_port,
    wait_for,
)

pytestmark = [pytest.mark.slow, needs_browser]


@pytest.fixture(scope="module")
def url(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, address = serve_on_a_quiet_port((), tmp_path_factory.mktemp("axis") / "serve.log")
    yield address
    proc.terminate()
    proc.wait(120)


def _row(driver: Any, text: str, outcome: str | None = None) -> Any:
    sel = ".req[data-req]" + (f"[data-outcome={outcome}]" if outcome else "")
    for r in driver.find_elements("css selector", sel):
        if text in r.text:
            return r
    return None


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

    short = wait_for(lambda: _row(browser, f"({tag}/2)", "length"), 30, "short request missing")
    long = wait_for(lambda: _row(browser, f"({tag}/24)", "length"), 30, "long request missing")
    cut = wait_for(lambda: _row(browser, f"sea. ({tag})", "cancelled"), 60, "no cancelled row")
    gone = wait_for(lambda: _row(browser, f"no-such-route-{tag}", "refused"), 30, "no 404 row")
    assert "cancelled" in cut.text and cut.find_elements("css selector", ".bar i.end.cancelled")
    assert "404" in gone.text
    span = browser.find_element("css selector", ".timeaxis").get_attribute("data-span")
    widths = {
        name: row.find_element("css selector", ".bar i.span").rect["width"]
        for name, row in (("short", short), ("long", long))
    }
    seconds = {
        name: float(row.find_element("css selector", ".bar i.span").get_attribute("data-width"))
        for name, row in (("short", short), ("long", long))
    }
    # One axis: widths in proportion to durations (within rounding and a minimum width);
    # which one took longer is this loaded box's business.
    assert seconds["long"] != seconds["short"] and widths["long"] != widths["short"], widths
    ratio = (widths["long"] / widths["short"]) / (seconds["long"] / seconds["short"])
    assert 0.5 < ratio < 2.0, (widths, seconds, span)
    out = os.environ.get("DISAGG_UI_SHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "ui-timeaxis.png").write_bytes(browser.get_screenshot_as_png())

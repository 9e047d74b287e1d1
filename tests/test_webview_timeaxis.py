"""The web view's request list on one time axis, in headless chromium against a
gateway of its own (`disagg serve`'s app over real agents): a longer request has a
longer bar, a cancelled stream is marked cancelled, a 404 is listed. With
DISAGG_UI_SHOTS=DIR the page is saved as DIR/ui-timeaxis.png."""

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

from tests.agentpool import AgentPool, AgentSet
from tests.gateways import client_over, start_gateway
from tests.test_webview_live import (
    MODEL,
    agents_on_page,
    browser,  # noqa: F401  (the fixture)
    needs_browser,
    wait_for,
)

pytestmark = [pytest.mark.slow, needs_browser]


@pytest.fixture(scope="module")
def url(smol_set: AgentSet, agent_pool: AgentPool) -> Iterator[str]:
    """`disagg serve`'s app in this process, this module's own (its request list is
    this module's requests), over the pooled SmolLM2 agents."""
    gateway = start_gateway(client_over({MODEL: smol_set}, agent_pool.token))
    try:
        yield gateway.url
    finally:
        gateway.stop()


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

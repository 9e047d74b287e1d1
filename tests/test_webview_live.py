"""The web view of live gateways (`disagg serve --local`'s app, in this process,
over the session's agents), in Debian's headless chromium driven by selenium: one
gateway with an API key, one without (loopback). Also: every Grafana panel names a
metric the live /metrics exports.

With DISAGG_UI_SHOTS=DIR the browser's screenshots (laptop and phone widths,
light and dark) are written there; docs/ui*.png come from that.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agentpool import AgentSet
from tests.conftest import PairFactory, free_port
from tests.gateways import Gateways, client_over, start_gateway
from tests.tinymodels import shared_tiny

pytestmark = pytest.mark.slow

KEY = "webview-test-key-" + "x" * 16
MODEL = "SmolLM2-135M-Instruct"
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "disagg.json"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's headless chromium and its driver: apt-get install chromium "
    "chromium-driver (CI installs both)",
)


@pytest.fixture(scope="module")
def served(gateways: Gateways, smol_set: AgentSet) -> dict[str, tuple[None, str]]:
    """{"open": (None, url), "keyed": (None, url)}: the gateway without a key and
    the one with `--api-key KEY`, over the default model's agents."""
    models = {MODEL: smol_set}
    return {
        "open": (None, gateways.get(models).url),
        "keyed": (None, gateways.get(models, api_keys=[KEY]).url),
    }


def ask(url: str, prompt: str, key: str = "unused", placement: str = "auto") -> Any:
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
    return oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0,
        extra_body={"placement": placement},
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(DRIVER)))
    yield driver
    driver.quit()


def wait_for(what: Callable[[], Any], seconds: float, message: str) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        try:
            got = what()
        except Exception as e:  # selenium's, named so the module imports without it
            if type(e).__name__ != "StaleElementReferenceException":
                raise
            got = None  # the page re-rendered a row between finding and reading it
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.2)


# The cluster picture as ui.js's topology() draws it for the box's width now.
REDRAWN_JS = """
const box = document.getElementById("topology"), svg = box && box.querySelector("svg");
return !!svg && svg.viewBox.baseVal.width === Math.max(280, Math.min(1000, box.clientWidth - 24));
"""


def painted(driver: Any) -> None:
    """Two animation frames later: what the page holds now has been painted."""
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "requestAnimationFrame(() => requestAnimationFrame(() => done(true)));"
    )


def shoot(driver: Any, name: str, width: int, dark: bool) -> None:
    """A full-page screenshot at this width and colour scheme (DISAGG_UI_SHOTS or nowhere)."""
    out = os.environ.get("DISAGG_UI_SHOTS")
    if not out:
        return
    scheme = "dark" if dark else "light"
    driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": scheme}]},
    )
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": width < 700},
    )
    # A poll has redrawn the picture at the new width (not a fixed 1.5 s: at a width
    # the page already had, none is needed), then a frame painted.
    wait_for(lambda: driver.execute_script(REDRAWN_JS), 30, f"no redraw at {width}px")
    painted(driver)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 700},
    )
    painted(driver)
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"{name}.png").write_bytes(driver.get_screenshot_as_png())
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def agents_on_page(driver: Any) -> dict[str, str]:
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('[data-agent]')]"
        ".map(e => [e.dataset.agent, e.dataset.up]))"
    )


# ---- without a key, on loopback ----------------------------------------------------------


@needs_browser
def test_page_shows_the_agents_and_the_model(served: Any, browser: Any) -> None:
    _, url = served["open"]
    browser.get(f"{url}/ui")
    agents = wait_for(
        lambda: len(agents_on_page(browser)) == 2 and agents_on_page(browser), 30, "no agents"
    )
    assert agents == {"prefill@127.0.0.1": "true", "decode@127.0.0.1": "true"}
    body = browser.find_element("tag name", "body").text
    assert MODEL in body and "decode@127.0.0.1" in body
    # The picture: both agents drawn, and the link between them.
    assert len(browser.find_elements("css selector", "#topology [data-node]")) == 2
    assert browser.find_elements("css selector", "#topology path.link")
    # At 1400 px the cards' values read whole: the model name on one line, no value
    # over two, no line of one lone character (a model name once took three, and a
    # ")" stood alone).
    browser.set_window_size(1400, 1000)
    try:
        lines = wait_for(lambda: browser.execute_script(CARD_LINES), 10, "no cards")
    finally:
        browser.set_window_size(1280, 1000)
    assert all(n <= 2 for _, _, n, _ in lines), lines
    assert [n for label, _, n, _ in lines if label == "model"] == [1, 1], lines
    assert all(n == 1 or narrowest > 12 for _, _, n, narrowest in lines), lines


# Per value in the agent cards: [label, text, lines it takes, narrowest line in px].
CARD_LINES = """
return [...document.querySelectorAll('[data-agent] dd')].map(dd => {
  const r = document.createRange(); r.selectNodeContents(dd);
  const rects = [...r.getClientRects()].filter(x => x.width > 0);
  const tops = new Set(rects.map(x => Math.round(x.top)));
  return [dd.previousElementSibling.textContent, dd.textContent, tops.size,
          Math.min(...rects.map(x => x.width))];
});
"""


@needs_browser
def test_a_request_sent_after_the_page_opened_appears_with_its_timeline(
    served: Any, browser: Any
) -> None:
    _, url = served["open"]
    browser.get(f"{url}/ui")
    wait_for(lambda: agents_on_page(browser), 30, "page did not load")
    browser.execute_script("window.stillThisPage = true")
    prompt = f"Name a colour. ({time.time():.0f})"
    # Remote asked for (disagg's request field): the pooled agents' placement has
    # learned from earlier tests, and this test wants the K/V on the wire.
    answer = ask(url, prompt, placement="remote")
    assert answer.choices[0].message.content

    def row() -> Any:
        for r in browser.find_elements("css selector", ".req[data-state=done]"):
            if prompt in r.text:
                return r
        return None

    r = wait_for(row, 15, "the request never appeared on the page")
    assert browser.execute_script("return window.stillThisPage") is True  # no reload
    assert "disaggregated" in r.text
    for part in ("queue", "prefill", "kv", "decode", "tok"):
        assert r.find_elements("css selector", f".bar i.{part}"), f"no {part} segment"
    # The K/V arrives while the prefill computes: the two segments overlap.
    box = {
        part: r.find_element("css selector", f".bar i.{part}").rect for part in ("prefill", "kv")
    }
    pre, kv = box["prefill"], box["kv"]
    assert kv["x"] < pre["x"] + pre["width"] and pre["x"] < kv["x"] + kv["width"]


@needs_browser
def test_an_in_flight_request_shows_while_it_runs(served: Any, browser: Any) -> None:
    _, url = served["open"]
    browser.get(f"{url}/ui")
    wait_for(lambda: agents_on_page(browser), 30, "page did not load")
    prompt = f"Count from one to one hundred in words. ({time.time():.0f})"
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def long_request() -> None:
        # A raw prompt that runs on: about 120 tokens at this box's decode speed.
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0)

    worker = threading.Thread(target=long_request)
    worker.start()
    try:

        def running() -> Any:
            for r in browser.find_elements("css selector", ".req[data-state=running]"):
                if prompt[:30] in r.text:
                    return r.text
            return None

        text = wait_for(running, 30, "the request never showed as running")
        # Shown running only if a poll caught it running on the gateway (the page may
        # still show that a moment after it ended: no race with `done` is asserted).
        assert "prefilling" in text or "decoding" in text
    finally:
        worker.join(300)
    wait_for(
        lambda: any(
            prompt[:30] in r.text
            for r in browser.find_elements("css selector", ".req[data-state=done]")
        ),
        15,
        "the finished request never showed as done",
    )


def test_every_grafana_panel_names_a_metric_the_live_gateway_exports(served: Any) -> None:
    _, url = served["open"]
    ask(url, "Say hi.")
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p.get("type") != "row"]
    named = 0
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = set(re.findall(r"\bdisagg_[a-z0-9_]+", t["expr"]))
            assert names, f"{p['title']}: no disagg metric in {t['expr']}"
            missing = names - exported
            assert not missing, f"{p['title']}: {missing} not in /metrics"
            named += len(names)
    assert len(panels) >= 10 and named >= 15
    # The request just made is counted, by how it ended (12 tokens: stop or length).
    ended = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "disagg_gateway_requests_total"
        and s.labels.get("outcome") in ("stop", "length")
    ]
    assert sum(ended) >= 1


# ---- with --api-key ----------------------------------------------------------------------


@needs_browser
def test_without_the_key_no_agent_or_prompt_appears(served: Any, browser: Any) -> None:
    _, url = served["keyed"]
    secret_prompt = f"Tell me about otters ({time.time():.0f})."
    ask(url, secret_prompt, key=KEY)
    browser.delete_all_cookies()
    browser.get(f"{url}/ui")
    assert browser.find_elements("css selector", "input[name=key]")
    time.sleep(2.5)  # give any script time to fetch what it could
    page = browser.page_source + browser.find_element("tag name", "body").text
    for secret in ("@127.0.0.1", secret_prompt[:20], "otters", MODEL):
        assert secret not in page, secret
    # The key in the address once: a cookie, and the key leaves the address bar.
    browser.get(f"{url}/ui?key={KEY}")
    wait_for(lambda: len(agents_on_page(browser)) == 2, 30, "no agents after signing in")
    assert browser.current_url == f"{url}/ui"
    wait_for(lambda: "otters" in browser.find_element("tag name", "body").text, 10, "no prompt")
    (cookie,) = browser.get_cookies()
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert cookie["domain"] == "127.0.0.1" and cookie["path"] == "/ui"  # host-only
    assert browser.execute_script("return document.cookie") == ""  # scripts cannot read it


class Recorder(http.server.ThreadingHTTPServer):
    """Answers anything with a small page and keeps each request's path and Cookie."""

    def __init__(self, page: str = "") -> None:
        self.seen: list[tuple[str, str]] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.seen.append((self.path, self.headers.get("Cookie") or ""))
                raw = page.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *a: Any) -> None:
                pass

        super().__init__(("127.0.0.1", free_port()), H)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()


@needs_browser
def test_the_cookie_never_goes_with_another_sites_requests(served: Any, browser: Any) -> None:
    _, url = served["keyed"]
    browser.get(f"{url}/ui?key={KEY}")
    wait_for(lambda: agents_on_page(browser), 30, "not signed in")
    # A stand-in for this host at another port, and a page of another site
    # (localhost is not 127.0.0.1 to a browser) that calls it every way it can.
    target = Recorder()
    tport = target.server_address[1]
    evil = Recorder(
        f'<img src="http://127.0.0.1:{tport}/ui/api/img">'
        f'<iframe src="http://127.0.0.1:{tport}/ui/api/frame"></iframe>'
        f'<form id="f" method="get" action="http://127.0.0.1:{tport}/ui/api/form"></form>'
        f"<script>fetch('http://127.0.0.1:{tport}/ui/api/fetch',"
        f"{{credentials:'include',mode:'no-cors'}});"
        "setTimeout(()=>document.getElementById('f').submit(),500)</script>"
    )
    try:
        browser.get(f"http://localhost:{evil.server_address[1]}/")
        wait_for(lambda: len(target.seen) >= 4, 15, f"the page's requests: {target.seen}")
        leaked = [(p, c) for p, c in target.seen if "disagg_ui=" in c]
        assert not leaked, leaked
        # Control: the browser does hold the cookie, and sends it on a same-site visit.
        browser.get(f"http://127.0.0.1:{tport}/ui/api/typed")
        typed = wait_for(
            lambda: [c for p, c in target.seen if p == "/ui/api/typed"], 10, "no typed visit"
        )
        assert "disagg_ui=" in typed[0]
    finally:
        target.shutdown()
        evil.shutdown()


@needs_browser
def test_screenshots_for_the_docs(
    served: Any, browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some traffic (a few at once, short and long prompts), then the page at a
    laptop's and a phone's width, light and dark: into DISAGG_UI_SHOTS for the docs,
    else into a temp dir, checked either way."""
    if not os.environ.get("DISAGG_UI_SHOTS"):
        monkeypatch.setenv("DISAGG_UI_SHOTS", str(tmp_path))
    _, url = served["open"]
    browser.get(f"{url}/ui")
    wait_for(lambda: agents_on_page(browser), 30, "page did not load")
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain what a KV cache is. " * 12,
        "Translate 'good morning' to Spanish.",
        "What is 12 times 12?",
    ]
    batch = [threading.Thread(target=ask, args=(url, p)) for p in prompts]  # all at once
    for t in batch:
        t.start()
    for t in batch:
        t.join()
    done = ".req[data-state=done]"
    wait_for(
        lambda: len(browser.find_elements("css selector", done)) >= len(prompts),
        30,
        "the requests' rows not all done on the page",
    )
    shots = {"ui": 1280, "ui-dark": 1280, "ui-phone": 390, "ui-phone-dark": 390}
    for name, width in shots.items():
        shoot(browser, name, width, dark=name.endswith("dark"))
    # Each shot a PNG at its width, the full page tall, the requests' rows on it.
    for name, width in shots.items():
        png = Path(os.environ["DISAGG_UI_SHOTS"], f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", name
        w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert w == width and h >= 900, (name, w, h)
    rows = browser.find_elements("css selector", ".req[data-state=done]")
    assert len(rows) >= len(prompts), len(rows)


# ---- last: an agent dies -----------------------------------------------------------------


@needs_browser
def test_a_dead_agent_turns_red(browser: Any, fresh_agents: PairFactory) -> None:
    # Agents and a gateway of its own: it kills the decode agent.
    agents = fresh_agents.set(shared_tiny("llama"))
    gw = start_gateway(client_over({"tiny": agents}, agents.prefill.token or b""))
    try:
        _turns_red(agents.decodes[0].proc.pid, gw.url, browser)
    finally:
        gw.stop()


def _turns_red(decode_pid: int, url: str, browser: Any) -> None:
    browser.get(f"{url}/ui")
    wait_for(lambda: agents_on_page(browser).get("decode@127.0.0.1") == "true", 30, "not up")
    os.kill(decode_pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(  # a hang guard; how soon is a figure (printed below)
        lambda: agents_on_page(browser).get("decode@127.0.0.1") == "false", 60, "still not red"
    )
    took = time.monotonic() - t0
    card = browser.find_element("css selector", '[data-agent="decode@127.0.0.1"]')
    assert "down" in card.get_attribute("class") and "exited" in card.text
    node = browser.find_element("css selector", '#topology [data-node="decode@127.0.0.1"]')
    assert node.get_attribute("class") == "down"
    assert agents_on_page(browser)["prefill@127.0.0.1"] == "true"
    print(f"decode agent killed: red on the page after {took:.1f}s")

"""The router's /health probe: a slow answer from an agent that was fine a moment
ago is a busy agent, not a dead one; a refused connection, a bad answer, or a
slow agent never seen healthy (or just failed over) is down. Real HTTP servers on
127.0.0.1, the router's own urllib probe."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.serving.router import Endpoint, Route, Router


class Agent:
    """A /health that answers ok, or ok after `delay` s (longer than the probe's 1 s)."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.answer = {"ok": True}
        self.release = threading.Event()  # set at teardown: no handler outlives the test
        self.answered = threading.Event()  # a delayed answer was written
        me = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                late = me.delay > 0
                me.release.wait(me.delay)
                if late:
                    me.answered.set()
                body = json.dumps(me.answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent()
    yield a
    a.release.set()
    a.server.shutdown()
    a.server.server_close()


def router_for(port: int) -> tuple[Router, Endpoint]:
    ep = Endpoint("d1", "127.0.0.1", 1, control_port=port)
    return Router([Route("m", [], [ep])]), ep


def probe(r: Router, ep: Endpoint) -> bool:
    r.health.clear()  # past the cache's TTL: probe now
    return r._healthy(ep)


def test_a_slow_answer_right_after_an_ok_is_busy_not_down(agent: Agent) -> None:
    r, ep = router_for(agent.port)
    assert probe(r, ep)
    agent.delay = 60.0  # far past the probe's 1 s timeout
    assert probe(r, ep), "a busy agent that answered ok a moment ago was marked down"
    assert not agent.answered.is_set()  # the probe gave up (its timeout) before the answer came
    r.health.clear()
    agent.delay = 1.6
    assert ep.name in r.decode_order([ep], [])[1].busy  # still a candidate for affinity


def test_a_slow_agent_never_seen_healthy_is_down(agent: Agent) -> None:
    agent.delay = 1.6
    r, ep = router_for(agent.port)
    assert not probe(r, ep)


def test_failing_over_forgets_the_grace(agent: Agent) -> None:
    r, ep = router_for(agent.port)
    assert probe(r, ep)
    r._mark_down(ep)  # what a request that hit the idle deadline does
    assert not r._healthy(ep)
    r.down_until.clear()  # its down time is over: probed again, still silent
    agent.delay = 1.6
    assert not probe(r, ep)


def test_a_bad_answer_or_a_closed_port_is_down_at_once(agent: Agent) -> None:
    r, ep = router_for(agent.port)
    assert probe(r, ep)
    agent.answer = {"ok": False}
    assert not probe(r, ep)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    r2, ep2 = router_for(closed)
    r2.last_ok[ep2.name] = time.monotonic()  # even if it answered ok a moment ago
    assert not probe(r2, ep2)

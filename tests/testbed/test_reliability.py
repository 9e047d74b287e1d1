"""Reliability on the four-host test bed (issue 6, items 3-5), each test with figures.

Faults: SIGKILL of an agent mid-prefill and mid-decode, both fast links cut
mid-traffic, 5 % loss + 50 ms delay on a data link and on the client's switch
path, clients that open a KV socket and say nothing, clients gone mid-stream;
then no session, socket, thread or memory left behind on any agent over >= 200
requests (read from /proc: the hosts share this machine). Load: 64 concurrent
requests across both pipelines, each equal to the same request run alone, p50/p99
latency. Graceful restart: `disagg restart` with requests in flight loses none.

The tests run in order on one fleet this module deploys and starts, and stops at
the end. Requests go out from the ops namespace: a pool of threads that joined it
(setns is per thread), so the test's own thread injects faults while they run.
Each test prints its figures (run with -s); docs/reliability.md records them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import statistics
import struct
import sys
import threading
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agents import protocol as P
from agents.server import HANDSHAKE_TIMEOUT_S
from disagg.api import Client, Completion
from disagg.errors import DisaggError, UsageError
from disagg.fleet.routing import router_from_inventory
from disagg.serving import wireclient as wire
from disagg.serving.batch import run_batch
from disagg.serving.request import build_request
from tests.testbed.bed import BY_NAME, SWITCH, TestBed, in_ns, sh
from tests.testbed.conftest import PIPELINES, FleetCli

pytestmark = pytest.mark.testbed

T = TypeVar("T")
MODELS = list(PIPELINES)  # qwen3-coder-30b: dgx-spark-1 -> mac-studio-2; gpt-oss-120b: 2 -> 1
PREFILL = {m: PIPELINES[m][0] for m in MODELS}
DECODE = {m: PIPELINES[m][1] for m in MODELS}
MODEL_OF = {h: m for m, hosts in PIPELINES.items() for h in hosts}
MAX_TOKENS = 6  # SmolLM2 decodes ~4-5 tokens/s per pipeline here
PROMPTS = (
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Name a large animal.",
)
# ~150 tokens: about 0.7 s of torch prefill on one core, time to land a SIGKILL in.
LONG_PROMPT = "Sum up this list in one word: " + ", ".join(f"item {i}" for i in range(40))
REQUEST_TIMEOUT_S = 180.0  # the inventory's decode_timeout
FIGURES: dict[str, Any] = {}


def say(what: str, figures: dict[str, Any]) -> None:
    """Print a test's figures (pytest -s shows them) and keep them for the summary."""
    FIGURES[what] = figures
    sys.stdout.write(f"\nFIGURES {what}: {json.dumps(figures, sort_keys=True)}\n")
    sys.stdout.flush()


# ---- the ops namespace, per thread --------------------------------------------------------

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def join_netns(name: str) -> None:
    """Move the calling thread, and the threads it starts later, into netns `name`."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


# ---- the agents as processes ---------------------------------------------------------------


def agent_pid(host: str) -> int:
    m = BY_NAME[host]
    return int((m.home / ".disagg" / "run" / f"{m.role}.pid").read_text().strip())


def usage(pid: int) -> dict[str, int]:
    """Open fds, threads and resident memory (kB) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:"))
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss_kb": rss,
    }


def socket_count(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


def agent_log(host: str) -> str:
    m = BY_NAME[host]
    return (m.home / ".disagg" / "logs" / f"{m.role}.log").read_text(errors="replace")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


# ---- what the tests share -----------------------------------------------------------------


@dataclass
class Ledger:
    """Requests of the leak window (from the first fault after the kills to the leak check)."""

    counts: Counter[str] = field(default_factory=Counter)
    baseline: dict[str, dict[str, int]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        self.counts[kind] += n

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Rig:
    bed: TestBed
    inventory: Path
    cli: FleetCli
    pool: ThreadPoolExecutor
    token: bytes
    client: Client | None = None
    refs: dict[tuple[str, str], Completion] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    errors: list[str] = field(default_factory=list)  # every clear error a request ended in

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run fn in the ops namespace."""
        return self.pool.submit(fn, *args, **kwargs)

    def in_ops(self, fn: Callable[..., T], *args: Any, timeout: float = 300, **kw: Any) -> T:
        return self.submit(fn, *args, **kw).result(timeout)

    def make_client(self) -> Client:
        router = router_from_inventory(str(self.inventory))
        router.token = self.token
        return Client(router=router)

    def gen(self, model: str, prompt: str, **extra: Any) -> Completion:
        """One greedy request through the fleet (call in an ops thread)."""
        assert self.client is not None
        args: dict[str, Any] = {"max_tokens": MAX_TOKENS, "placement": "remote", **extra}
        c = self.client.generate(model=model, prompt=prompt, **args)
        assert isinstance(c, Completion)
        return c

    def check(self, model: str, prompt: str, c: Completion) -> None:
        ref = self.refs[(model, prompt)]
        assert c.token_ids == ref.token_ids and c.text == ref.text, (model, prompt, c, ref)

    def status(self, host: str) -> dict[str, Any]:
        """An agent's /status over the switch (call in an ops thread)."""
        m = BY_NAME[host]
        port = 8010 if m.role == "prefill" else 8011
        req = urllib.request.Request(f"http://{m.switch_addr}:{port}/status")
        req.add_header("Authorization", f"Bearer {self.token.decode()}")
        with urllib.request.urlopen(req, timeout=3) as resp:
            return dict(json.loads(resp.read()))

    def busy(self, host: str) -> int:
        st = self.status(host)
        return int(st["in_flight"]) + int(st.get("queued") or 0)

    def fleet_status(self) -> dict[str, str]:
        proc = self.cli("status", "--json", "-i", str(self.inventory), timeout=120)
        return {r["host"]: r["state"] for r in json.loads(proc.stdout)}

    def start_host(self, host: str) -> float:
        """`disagg start HOST`, then status healthy everywhere; returns its seconds."""
        t0 = time.monotonic()
        proc = self.cli("start", host, "-i", str(self.inventory), timeout=400)
        took = time.monotonic() - t0
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "started" in proc.stdout, proc.stdout
        states = self.fleet_status()
        assert set(states.values()) == {"healthy"}, states
        return took

    def serves_both(self) -> None:
        """Each pipeline answers a request with the reference text."""
        futs = {m: self.submit(self.gen, m, PROMPTS[0]) for m in MODELS}
        for m, fut in futs.items():
            self.check(m, PROMPTS[0], fut.result(REQUEST_TIMEOUT_S))


@pytest.fixture(scope="module")
def rig(testbed: TestBed, inventory: Path, fleet_cli: FleetCli) -> Iterator[Rig]:
    """Deploy and start the fleet; the greedy reference of every prompt, each run alone on
    its pipeline; at the end, stop the fleet and check every agent stopped."""
    t0 = time.monotonic()
    dep = fleet_cli("deploy", "-i", str(inventory), "--json", timeout=400)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    token = (testbed.ops_dir / "cluster.token").read_bytes().strip()
    pool = ThreadPoolExecutor(80, "ops", initializer=join_netns, initargs=("ops",))
    rig = Rig(testbed, inventory, fleet_cli, pool, token)
    try:
        started = fleet_cli("start", "-i", str(inventory), timeout=400)
        assert started.returncode == 0, started.stdout + started.stderr
        assert set(rig.fleet_status().values()) == {"healthy"}
        rig.client = rig.in_ops(rig.make_client)
        up = time.monotonic() - t0

        def alone(model: str) -> dict[tuple[str, str], Completion]:
            return {(model, p): rig.gen(model, p) for p in (*PROMPTS, LONG_PROMPT)}

        t1 = time.monotonic()
        for fut in [rig.submit(alone, m) for m in MODELS]:  # one request at a time per pipeline
            rig.refs.update(fut.result(600))
        for (model, prompt), c in rig.refs.items():
            assert c.metrics["method"] == "disaggregated" and c.token_ids, (model, prompt, c)
        assert "Paris" in rig.refs[(MODELS[0], PROMPTS[0])].text
        say(
            "fleet",
            {
                "deploy_and_start_s": round(up, 1),
                "references_s": round(time.monotonic() - t1, 1),
                "references": {f"{m} | {p[:30]}": c.text for (m, p), c in rig.refs.items()},
                "long_prompt_tokens": rig.refs[(MODELS[0], LONG_PROMPT)].metrics["prompt_tokens"],
                "long_prompt_prefill_s": rig.refs[(MODELS[0], LONG_PROMPT)].metrics["prefill_time"],
            },
        )
        yield rig
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        stopped = fleet_cli("stop", "-i", str(inventory), timeout=300)
        states = rig.fleet_status()
        sys.stdout.write(f"\nSUMMARY {json.dumps(FIGURES, sort_keys=True, default=str)}\n")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert set(states.values()) == {"stopped"}, states


def traffic(
    rig: Rig, model: str, n: int, done: list[Any], prompts: tuple[str, ...] = PROMPTS
) -> None:
    """n requests one after the other on `model`'s pipeline (in an ops thread); each ends
    in the reference text or a clear error; appends (outcome, seconds, metrics) to done."""
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        t0 = time.monotonic()
        try:
            c = rig.gen(model, prompt)
            rig.check(model, prompt, c)
            done.append(("ok", time.monotonic() - t0, c.metrics))
        except DisaggError as e:
            rig.errors.append(f"{model}: {e}")
            done.append(("error", time.monotonic() - t0, {"error": str(e)}))


def path(metrics: dict[str, Any]) -> str:
    """Which way a request's KV came: over the fast link, the switch, or not at all."""
    addr = metrics.get("prefill_address") or ""
    return "switch" if addr.startswith("10.77.") else "fast link" if addr else "local"


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(step)


# ---- faults: SIGKILL ------------------------------------------------------------------------


@pytest.mark.fault
def test_sigkill_prefill_mid_prefill(rig: Rig) -> None:
    """The qwen pipeline's prefill agent dies while it computes a ~150-token prompt: the
    decode agent prefills locally and the request still ends in the reference text; the
    other pipeline serves on meanwhile; `disagg start HOST` brings the agent back."""
    model, host = MODELS[0], PREFILL[MODELS[0]]
    other: list[Any] = []
    side = rig.submit(traffic, rig, MODELS[1], 3, other)
    pid = agent_pid(host)
    t0 = time.monotonic()
    fut = rig.submit(rig.gen, model, LONG_PROMPT)
    rig.in_ops(wait_until, lambda: rig.status(host)["in_flight"] > 0, 60, "the prefill to start")
    time.sleep(0.3)  # about half way through its ~0.7 s
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic() - t0
    c = fut.result(REQUEST_TIMEOUT_S)
    took = time.monotonic() - t0
    assert c.metrics["method"] == "local-fallback", c.metrics
    assert "failed" in c.metrics["fallback_reason"], c.metrics  # the stream broke mid-way
    rig.check(model, LONG_PROMPT, c)
    side.result(REQUEST_TIMEOUT_S)
    assert [o for o, *_ in other] == ["ok"] * 3, other
    restart_s = rig.start_host(host)
    rig.serves_both()
    say(
        "sigkill prefill mid-prefill",
        {
            "killed_after_s": round(killed_at, 2),
            "request_s": round(took, 1),
            "method": c.metrics["method"],
            "fallback_reason": c.metrics["fallback_reason"],
            "text_equal_reference": True,
            "other_pipeline_ok": len(other),
            "restart_s": round(restart_s, 1),
        },
    )


@pytest.mark.fault
def test_sigkill_decode_mid_decode(rig: Rig) -> None:
    """The gpt-oss pipeline's decode agent dies while it streams tokens: the client gets a
    clear error at once, not a hang or a truncated text passed off as an answer; the other
    pipeline serves on; `disagg start HOST` brings the agent back."""
    model, host = MODELS[1], DECODE[MODELS[1]]
    other: list[Any] = []
    side = rig.submit(traffic, rig, MODELS[0], 3, other)
    pid = agent_pid(host)
    assert rig.client is not None
    client = rig.client

    def doomed() -> tuple[int, float, str]:
        chunks = client.generate(
            model=model,
            prompt=PROMPTS[0],
            max_tokens=64,
            ignore_eos=True,
            placement="remote",
            stream=True,
        )
        assert not isinstance(chunks, Completion)
        got = 0
        t_kill = 0.0
        try:
            for _chunk in chunks:
                got += 1
                if got == 2:  # streaming: kill it
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.monotonic()
            raise AssertionError("the stream ended without an error")
        except DisaggError as e:
            return got, time.monotonic() - t_kill, str(e)

    got, err_after, message = rig.in_ops(doomed, timeout=REQUEST_TIMEOUT_S)
    assert err_after < 10, err_after
    assert "decode" in message, message
    side.result(REQUEST_TIMEOUT_S)
    assert [o for o, *_ in other] == ["ok"] * 3, other
    restart_s = rig.start_host(host)
    rig.serves_both()
    say(
        "sigkill decode mid-decode",
        {
            "chunks_before_kill": got,
            "error_after_s": round(err_after, 2),
            "error": message,
            "other_pipeline_ok": len(other),
            "restart_s": round(restart_s, 1),
        },
    )


# ---- faults on the network and from clients; the leak window opens here -------------------


@pytest.fixture(scope="module")
def window(rig: Rig) -> Ledger:
    """Baseline of every agent (warm, idle) before the faults the leak check covers."""
    led = rig.ledger
    rig.serves_both()  # warm after the kills' restarts
    led.pids = {h: agent_pid(h) for h in BY_NAME}
    led.baseline = {h: {**usage(pid), "sockets": socket_count(pid)} for h, pid in led.pids.items()}
    return led


def cut_link_mid_traffic(rig: Rig, model: str) -> dict[str, Any]:
    """Cut the pipeline's fast link twice (in an ops thread): 4 s in the middle of a KV
    stream, then 6 s between streams, while requests go on one after another."""
    assert rig.client is not None
    link, host = BY_NAME[PREFILL[model]].link, PREFILL[model]
    # In the middle of a KV stream: the stream waits the cut out (TCP retransmits).
    fut = rig.submit(rig.gen, model, LONG_PROMPT)
    wait_until(lambda: rig.status(host)["in_flight"] > 0, 60, "the prefill to start")
    time.sleep(0.2)
    rig.bed.link(link, up=False)
    time.sleep(4)
    rig.bed.link(link, up=True)
    t0 = time.monotonic()
    mid = fut.result(REQUEST_TIMEOUT_S)
    mid_after_up = time.monotonic() - t0
    rig.check(model, LONG_PROMPT, mid)
    # Between streams: cut as a request decodes; the next ones take the switch.
    chunks = rig.client.generate(
        model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, placement="remote", stream=True
    )
    assert not isinstance(chunks, Completion)
    restore = threading.Timer(6.0, rig.bed.link, (link, True))
    for chunk in chunks:
        if not restore.is_alive() and not chunk.done:
            rig.bed.link(link, up=False)
            restore.start()
        if chunk.completion:
            rig.check(model, PROMPTS[0], chunk.completion)
    during: list[Any] = []
    traffic(rig, model, 3, during)
    restore.join()
    after: list[Any] = []
    traffic(rig, model, 1, after)
    assert [o for o, *_ in during + after] == ["ok"] * 4, during + after
    via = [path(met) for _, _, met in during]
    assert via[0] == "switch", via
    assert path(after[0][2]) == "fast link", after
    return {
        "mid_kv_stream": {
            "request_s": round(mid.metrics["total_time"], 1),
            "done_after_link_up_s": round(mid_after_up, 1),
            "method": mid.metrics["method"],
            "prefill_via": path(mid.metrics),
        },
        "between_streams": {
            "prefill_via_during_cut": via,
            "request_s_during_cut": [round(t, 1) for _, t, _ in during],
            "prefill_via_after": path(after[0][2]),
        },
        "requests": 6,
        "lost": 0,
    }


@pytest.mark.fault
def test_fast_links_down_mid_traffic(rig: Rig, window: Ledger) -> None:
    """Each pipeline's fast data link goes down twice while it serves: 4 s in the middle of
    a KV stream (the stream stalls and completes when the link is back), and 6 s between
    KV streams (the next requests take the switch, then the link again). Every request
    ends in the reference text."""
    futs = {m: rig.submit(cut_link_mid_traffic, rig, m) for m in MODELS}
    figures = {m: f.result(REQUEST_TIMEOUT_S * 4) for m, f in futs.items()}
    window.add("link down", sum(f["requests"] for f in figures.values()))
    say("fast links down mid-traffic", figures)


TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(ns: str, name: str) -> int:
    """A tun device `name` in namespace `ns`, alive while the returned fd is open."""
    box: dict[str, Any] = {}

    def make() -> None:
        try:
            join_netns(ns)  # a tun device is born in the netns that opened /dev/net/tun
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
            box["fd"] = fd
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=make)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return int(box["fd"])


class LossyPath:
    """`tc netem delay D loss L` done in user space, for kernels without netem (this
    one): the traffic between two addresses in two namespaces is routed (/32 routes,
    more specific than the subnet's) through a tun device at each end; a thread per
    direction holds every packet D seconds and drops a fraction L of them."""

    def __init__(
        self, a: tuple[str, str], b: tuple[str, str], name: str, delay_s: float, loss: float
    ) -> None:
        self.a, self.b, self.name = a, b, name
        self.delay_s, self.loss = delay_s, loss
        self.rng = random.Random(6)
        self.stop = threading.Event()
        self.packets = self.dropped = 0
        self.fds: list[int] = []
        self.threads: list[threading.Thread] = []

    def __enter__(self) -> LossyPath:
        (ns_a, addr_a), (ns_b, addr_b) = self.a, self.b
        self.fds = [open_tun(ns_a, self.name), open_tun(ns_b, self.name)]
        for ns, src, dst in ((ns_a, addr_a, addr_b), (ns_b, addr_b, addr_a)):
            sh("ip", "-n", ns, "link", "set", self.name, "mtu", "1500", "up")
            sh("ip", "-n", ns, "route", "add", f"{dst}/32", "dev", self.name, "src", src)
        for fd_in, fd_out in ((self.fds[0], self.fds[1]), (self.fds[1], self.fds[0])):
            t = threading.Thread(target=self._pump, args=(fd_in, fd_out), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _pump(self, src: int, dst: int) -> None:
        held: deque[tuple[float, bytes]] = deque()
        while not self.stop.is_set():
            wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.05
            readable, _, _ = select.select([src], [], [], min(wait, 0.05))
            if readable:
                pkt = os.read(src, 65536)
                self.packets += 1
                if self.rng.random() < self.loss:
                    self.dropped += 1
                else:
                    held.append((time.monotonic() + self.delay_s, pkt))
            now = time.monotonic()
            while held and held[0][0] <= now:
                with contextlib.suppress(OSError):
                    os.write(dst, held.popleft()[1])

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for fd in self.fds:
            os.close(fd)  # the devices and their routes go with them


def have_netem() -> bool:
    ns = BY_NAME["dgx-spark-2"].name
    ok = in_ns(ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
    if ok.returncode == 0:
        in_ns(ns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return ok.returncode == 0


@contextlib.contextmanager
def impaired(delay_ms: int, loss_pct: float) -> Iterator[dict[str, Any]]:
    """Loss and delay, both ways, on the gpt-oss pipeline's data link (dgx-spark-2 <->
    mac-studio-1) and on the switch path between ops and mac-studio-1."""
    s2, m1 = BY_NAME["dgx-spark-2"], BY_NAME["mac-studio-1"]
    info: dict[str, Any] = {}
    if have_netem():
        info["how"] = "tc netem"
        spec = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        devs = [
            (s2.name, "fast0"),
            (m1.name, "fast0"),
            (m1.name, "eth0"),
            (SWITCH, "p-mac-studio-1"),
        ]
        for ns, dev in devs:
            sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *spec)
        try:
            yield info
        finally:
            for ns, dev in devs:
                rate, burst = ("10gbit", "2mb") if dev == "fast0" else ("1gbit", "256kb")
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", burst, "latency", "50ms")  # fmt: skip
        return
    info["how"] = "user-space tun relay (this kernel has no sch_netem)"
    d, loss = delay_ms / 1000, loss_pct / 100
    data = LossyPath((s2.name, s2.link_addr), (m1.name, m1.link_addr), "lossyd", d, loss)
    switch = LossyPath(("ops", "10.77.0.2"), (m1.name, m1.switch_addr), "lossys", d, loss)
    with data, switch:
        yield info
        info["data_link_packets"], info["data_link_dropped"] = data.packets, data.dropped
        info["switch_packets"], info["switch_dropped"] = switch.packets, switch.dropped


@pytest.mark.fault
def test_loss_and_delay(rig: Rig, window: Ledger) -> None:
    """5 % packet loss and 50 ms delay each way on the gpt-oss pipeline's data link and on
    the client's switch path to its decode agent: requests still end in the reference
    text (disaggregated, or prefilled locally if the KV stream outlasts its timeout)."""
    model, n = MODELS[1], 4
    done: list[Any] = []
    with impaired(50, 5.0) as info:
        t0 = time.monotonic()
        rig.in_ops(traffic, rig, model, n, done, timeout=REQUEST_TIMEOUT_S * n)
        wall = time.monotonic() - t0
    window.add("lossy", n)
    assert [o for o, *_ in done] == ["ok"] * n, done
    assert info.get("data_link_dropped", 1) > 0 and info.get("switch_dropped", 1) > 0, info
    clean: list[Any] = []
    rig.in_ops(traffic, rig, model, 1, clean)  # and fine again afterwards
    assert clean[0][0] == "ok", clean
    window.add("lossy", 1)
    say(
        "5% loss + 50 ms delay",
        {
            **info,
            "requests": n,
            "lost": 0,
            "wall_s": round(wall, 1),
            "per_request_s": [round(t, 2) for _, t, _ in done],
            "methods": dict(Counter(met["method"] for _, _, met in done)),
            "kv_fetch_s": [round(met.get("kv_fetch_time") or 0, 2) for _, _, met in done],
            "after_s": round(clean[0][1], 2),
        },
    )


def silent_socket(host: str) -> socket.socket:
    """Connect to an agent's data port (the KV socket on a prefill agent); say nothing."""
    m = BY_NAME[host]
    return socket.create_connection((m.switch_addr, 8000 if m.role == "prefill" else 8001), 5)


def dropped_after(sock: socket.socket) -> float:
    """Seconds until the agent hangs up on a silent client (it sends its challenge first)."""
    t0 = time.monotonic()
    sock.settimeout(HANDSHAKE_TIMEOUT_S + 15)
    P.recv_json(sock, P.Frame.CHALLENGE)
    assert sock.recv(1) == b""
    sock.close()
    return time.monotonic() - t0


@pytest.mark.fault
def test_silent_kv_clients(rig: Rig, window: Ledger) -> None:
    """Five connections to each agent's data port that never speak: real requests are
    served meanwhile, and each silent one is dropped after the handshake timeout."""
    socks = [rig.in_ops(silent_socket, h) for h in BY_NAME for _ in range(5)]
    t0 = time.monotonic()
    rig.serves_both()
    served_s = time.monotonic() - t0
    waits = [rig.submit(dropped_after, s) for s in socks]
    dropped = [w.result(HANDSHAKE_TIMEOUT_S + 30) for w in waits]
    assert max(dropped) < HANDSHAKE_TIMEOUT_S + 10, dropped
    window.add("silent", len(socks))
    window.add("ok", 2)
    say(
        "silent KV clients",
        {
            "silent_connections": len(socks),
            "served_meanwhile_s": round(served_s, 2),
            "dropped_after_s_max": round(max(dropped), 1),
            "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        },
    )


def gone_mid_stream(rig: Rig, model: str) -> float:
    """Start a 200-token stream, read two tokens, hang up; seconds until the decode agent
    is idle again."""
    assert rig.client is not None
    pipe = rig.client.router.pipeline(model)
    ep = pipe.decode[0]
    req = build_request(PROMPTS[1], max_tokens=200, ignore_eos=True, placement="remote")
    req["prefill"] = rig.client.router.prefill_target(pipe)
    events = wire.stream(ep.host, ep.port, req, token=rig.token)
    for _ in range(2):
        kind, _data = next(events)
        assert kind == "token", kind
    events.close()
    t0 = time.monotonic()
    wait_until(lambda: rig.busy(DECODE[model]) == 0, 30, "the decode agent to stop", 0.05)
    return time.monotonic() - t0


@pytest.mark.fault
def test_clients_gone_mid_stream(rig: Rig, window: Ledger) -> None:
    """Clients hang up two tokens into 200-token streams: the decode agent stops within a
    second or so, and the next request is served with the reference text."""
    n = 4
    idle: dict[str, list[float]] = {m: [] for m in MODELS}

    def run(model: str) -> None:
        for _ in range(n):
            idle[model].append(gone_mid_stream(rig, model))

    for f in [rig.submit(run, m) for m in MODELS]:
        f.result(REQUEST_TIMEOUT_S)
    window.add("gone mid-stream", 2 * n)
    for m in MODELS:
        assert "client went away" in agent_log(DECODE[m])
    rig.serves_both()
    window.add("ok", 2)
    worst = max(max(v) for v in idle.values())
    assert worst < 5, idle
    say("clients gone mid-stream", {"clients": 2 * n, "decode_idle_after_s_max": round(worst, 2)})


# ---- load ---------------------------------------------------------------------------------


def listen_overflows() -> dict[str, int]:
    """Each decode host's TcpExt ListenOverflows: connections its accept queue had no room for."""
    out = {}
    for m in MODELS:
        lines = in_ns(DECODE[m], "cat", "/proc/net/netstat").stdout.splitlines()
        names, values = next(
            (a.split(), b.split())
            for a, b in zip(lines, lines[1:], strict=False)
            if a.startswith("TcpExt:")
        )
        out[DECODE[m]] = int(values[names.index("ListenOverflows")])
    return out


@pytest.mark.load
def test_64_concurrent_requests(rig: Rig, window: Ledger) -> None:
    """64 requests at once, 32 per pipeline, four distinct prompts: all complete within a
    bound, each token-identical to the same request run alone; p50/p99 latency."""
    assert rig.client is not None
    reqs: list[dict[str, Any]] = [
        {"id": i, "model": MODELS[i % 2], "prompt": PROMPTS[(i // 2) % len(PROMPTS)]}
        for i in range(64)
    ]
    defaults = {"max_tokens": MAX_TOKENS, "placement": "remote"}
    overflows = listen_overflows()
    batch = rig.in_ops(run_batch, rig.client, reqs, defaults, 64, timeout=600)
    overflows = {h: n - overflows[h] for h, n in listen_overflows().items()}
    window.add("load", len(reqs))
    errors = [(r["id"], round(r["time"], 1), r["error"]) for r in batch.results if r.get("error")]
    assert batch.failed == 0, (overflows, errors)
    same = total = 0
    for req, row in zip(reqs, batch.results, strict=True):
        ref = rig.refs[(req["model"], req["prompt"])]
        total += len(ref.token_ids)
        same += sum(a == b for a, b in zip(row["token_ids"], ref.token_ids, strict=False))
        assert row["token_ids"] == ref.token_ids and row["text"] == ref.text, (row, ref.text)
        assert row["metrics"]["method"] == "disaggregated", row
    times = [r["time"] for r in batch.results]
    assert batch.wall_time < 300, batch.wall_time
    say(
        "load: 64 concurrent",
        {
            "requests": len(reqs),
            "completed": len(reqs) - batch.failed,
            "token_agreement": f"{same}/{total}",
            "wall_s": round(batch.wall_time, 1),
            "p50_s": round(pct(times, 50), 2),
            "p99_s": round(pct(times, 99), 2),
            "min_s": round(min(times), 2),
            "mean_s": round(statistics.mean(times), 2),
            "ttft_p50_s": round(pct([r["metrics"]["ttft"] for r in batch.results], 50), 2),
            "max_tokens": MAX_TOKENS,
            "listen_overflows": overflows,
        },
    )


# ---- no leaks -----------------------------------------------------------------------------


def mixed(rig: Rig, kind: str, model: str, silent: list[socket.socket]) -> None:
    """One request of a kind the leak check mixes in (in an ops thread)."""
    assert rig.client is not None
    if kind == "ok":
        out: list[Any] = []
        traffic(rig, model, 1, out)
        assert out[0][0] == "ok", out
    elif kind == "gone":
        gone_mid_stream(rig, model)
    elif kind == "silent":  # checked, and closed, at the end
        silent.append(silent_socket(PREFILL[model] if len(silent) % 2 else DECODE[model]))
    elif kind == "bad":
        ep = rig.client.router.pipeline(model).decode[0]
        with pytest.raises(UsageError):
            wire.generate(ep.host, ep.port, {"prompt": "", "max_tokens": 2}, token=rig.token)
    else:  # the prefill target is gone: the decode agent prefills locally, same text
        req = build_request(PROMPTS[2], max_tokens=MAX_TOKENS, placement="remote")
        req["prefill"] = {"hosts": [BY_NAME[PREFILL[model]].link_addr], "port": 1, "timeout": 5}
        res = rig.client.router.run(model, req)
        assert res.metrics["method"] == "local-fallback", res.metrics
        ref = rig.refs[(model, PROMPTS[2])]
        assert res.token_ids == ref.token_ids and res.text == ref.text, (res, ref)


@pytest.mark.fault
def test_no_leaks_over_200_requests(rig: Rig, window: Ledger) -> None:
    """Everything since the window opened, topped up with a mix (served, gone mid-stream,
    silent, bad, prefill target gone) to >= 200 requests: the agents are the same
    processes, idle, and hold no more fds, sockets or threads than before, nor much
    more memory."""
    plan = ["ok"] * 8 + ["gone"] * 6 + ["silent"] * 6 + ["bad"] * 6 + ["fallback"] * 2
    left = max(0, 200 - window.total)
    per_model = -(-left // 2)
    kinds = [plan[i % len(plan)] for i in range(per_model)]

    silent: list[socket.socket] = []

    def run(model: str) -> Counter[str]:
        done: Counter[str] = Counter()
        for kind in kinds:
            mixed(rig, kind, model, silent)
            done[kind] += 1
        return done

    t0 = time.monotonic()
    for f in [rig.submit(run, m) for m in MODELS]:
        for kind, count in f.result(600).items():
            window.add(f"top-up {kind}", count)
    waits = [rig.submit(dropped_after, s) for s in silent]
    assert max(w.result(HANDSHAKE_TIMEOUT_S + 30) for w in waits) < HANDSHAKE_TIMEOUT_S + 10
    topup_s = time.monotonic() - t0
    assert window.total >= 200, window.counts

    pids = {h: agent_pid(h) for h in BY_NAME}
    assert pids == window.pids, (window.pids, pids)  # nobody crashed or restarted
    rig.in_ops(wait_until, lambda: all(rig.busy(h) == 0 for h in BY_NAME), 60, "idle agents", 0.1)

    def now() -> dict[str, dict[str, int]]:
        return {h: {**usage(pid), "sockets": socket_count(pid)} for h, pid in pids.items()}

    base = window.baseline
    deadline = time.monotonic() + 30
    after = now()
    while time.monotonic() < deadline and not all(
        after[h][k] <= base[h][k] for h in base for k in ("fds", "threads", "sockets")
    ):
        time.sleep(0.25)
        after = now()
    report = {h: {k: f"{base[h][k]} -> {after[h][k]}" for k in base[h]} for h in sorted(base)}
    say(
        "no leaks",
        {
            "requests": window.total,
            "by_kind": dict(window.counts),
            "top_up_s": round(topup_s, 1),
            "agents": report,
            "rss_growth_kb_max": max(after[h]["rss_kb"] - base[h]["rss_kb"] for h in base),
        },
    )
    for h in base:
        for k in ("fds", "threads", "sockets"):
            assert after[h][k] <= base[h][k], (h, k, report[h])
        assert after[h]["rss_kb"] - base[h]["rss_kb"] < 64 * 1024, (h, report[h])
    for h in BY_NAME:
        st = rig.in_ops(rig.status, h)
        assert st["in_flight"] == 0 and not st.get("queued"), (h, st)


# ---- graceful restart ---------------------------------------------------------------------


@pytest.mark.fault
def test_restart_drains_requests_in_flight(rig: Rig) -> None:
    """`disagg restart` while each pipeline has four requests (one running, three queued):
    SIGTERM, the agents finish all of them, exit, start again; none is lost, each in the
    reference text; new requests are served after."""
    assert rig.client is not None
    before = {h: agent_pid(h) for h in BY_NAME}
    reqs: list[dict[str, Any]] = [
        {"id": i, "model": MODELS[i % 2], "prompt": PROMPTS[(i // 2) % len(PROMPTS)]}
        for i in range(8)
    ]
    defaults = {"max_tokens": MAX_TOKENS, "placement": "remote"}
    finished: Counter[str] = Counter()
    logs = {h: len(agent_log(h)) for h in BY_NAME}
    t0 = time.monotonic()
    fut = rig.submit(
        run_batch, rig.client, reqs, defaults, 8, on_done=lambda r: finished.update([r["model"]])
    )
    # Every request accepted by its decode agent (running, queued or done), none in a backlog.
    rig.in_ops(
        wait_until,
        lambda: all(rig.busy(DECODE[m]) + finished[m] == 4 for m in MODELS),
        60,
        "all eight requests accepted",
        0.05,
    )
    in_flight = {m: rig.in_ops(rig.status, DECODE[m])["in_flight"] for m in MODELS}
    t_restart = time.monotonic()
    proc = rig.cli("restart", "-i", str(rig.inventory), timeout=400)
    restart_s = time.monotonic() - t_restart
    assert proc.returncode == 0, proc.stdout + proc.stderr
    batch = fut.result(REQUEST_TIMEOUT_S)
    assert batch.failed == 0, [r for r in batch.results if r.get("error")]
    for req, row in zip(reqs, batch.results, strict=True):
        ref = rig.refs[(req["model"], req["prompt"])]
        assert row["token_ids"] == ref.token_ids and row["text"] == ref.text, (row, ref.text)
    done_by = max(r["time"] for r in batch.results) - (t_restart - t0)
    after = {h: agent_pid(h) for h in BY_NAME}
    assert all(after[h] != before[h] for h in BY_NAME), (before, after)
    for h in BY_NAME:
        log = agent_log(h)[logs[h] :]
        assert "drained and stopped" in log, (h, log[-2000:])
        assert "stopped with" not in log, h  # no request cut off at the drain timeout
    assert set(rig.fleet_status().values()) == {"healthy"}
    rig.serves_both()
    say(
        "graceful restart",
        {
            "requests_in_flight": len(reqs),
            "running_at_restart": in_flight,
            "lost": batch.failed,
            "methods": dict(Counter(r["metrics"]["method"] for r in batch.results)),
            "last_done_after_restart_began_s": round(done_by, 1),
            "restart_s": round(restart_s, 1),
            "served_after": 2,
        },
    )

"""The reliability tests' rig: the fleet under test driven from the ops namespace,
agent processes read from /proc, and the faults (links, a lossy tun relay,
silent sockets) the tests inject. No tests here; see test_reliability.py."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import re
import select
import socket
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from disagg.api import Client, Completion
from disagg.errors import DisaggError
from disagg.fleet.routing import router_from_inventory
from disagg_agents.runtime.gate import HANDSHAKE_TIMEOUT_S
from disagg_agents.wire.channel import recv_json
from disagg_agents.wire.frames import Frame
from disagg_agents.wire.httpauth import control_get
from disagg_agents.wire.status import AgentStatus
from tests.testbed.bed import BY_NAME, SWITCH, TestBed, in_ns, sh
from tests.testbed.conftest import PIPELINES, FleetCli

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
        # The whole prompt over the wire every time: the faults here land in the KV
        # stream, which a prefix-cache hit would shrink to one block.
        args: dict[str, Any] = {
            "max_tokens": MAX_TOKENS,
            "placement": "remote",
            "prefix_cache": False,
            **extra,
        }
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
        return dict(json.loads(control_get(m.switch_addr, port, "/status", self.token, 3)))

    def cached_kb(self, host: str) -> int:
        """kB of prompt K/V an agent's prefix cache holds (call in an ops thread): memory
        kept on purpose, within the cache's budget, not leaked."""
        cache = AgentStatus.from_json(self.status(host)).prefix_cache
        return (cache.bytes or 0) // 1024 if cache else 0

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


def path(metrics: Any) -> str:
    """Which way a request's KV came: over the fast link, the switch, or not at all."""
    addr = getattr(metrics, "prefill_address", None) or ""  # an error's entry has none
    return "switch" if addr.startswith("10.77.") else "fast link" if addr else "local"


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(step)


# ---- faults: SIGKILL ------------------------------------------------------------------------


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


def netem_drops(ns: str, dev: str) -> int:
    """Packets the root qdisc of `dev` in `ns` dropped (netem counts its losses there)."""
    out = sh("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev, "root").stdout
    found = re.search(r"\(dropped (\d+)", out)
    assert found, out
    return int(found[1])


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
            drops = {dev_ns: netem_drops(*dev_ns) for dev_ns in devs}
            info["data_link_dropped"] = sum(n for (_, d), n in drops.items() if d == "fast0")
            info["switch_dropped"] = sum(n for (_, d), n in drops.items() if d != "fast0")
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


def silent_socket(host: str) -> socket.socket:
    """Connect to an agent's data port (the KV socket on a prefill agent); say nothing."""
    m = BY_NAME[host]
    return socket.create_connection((m.switch_addr, 8000 if m.role == "prefill" else 8001), 5)


def dropped_after(sock: socket.socket) -> float:
    """Seconds until the agent hangs up on a silent client (it sends its challenge first)."""
    t0 = time.monotonic()
    sock.settimeout(HANDSHAKE_TIMEOUT_S + 15)
    recv_json(sock, Frame.CHALLENGE)
    assert sock.recv(1) == b""
    sock.close()
    return time.monotonic() - t0


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

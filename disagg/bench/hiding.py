"""Transfer hiding: how much of the KV handoff layer-wise streaming hides behind
prefill compute when the data link is slow.

The link is a copy of the test bed's fast data link: the prefill agent runs in a
network namespace of its own, joined to this one by a veth pair shaped with tbf
at each rate (1 and 10 Gbit/s), no default route anywhere. The decode agent runs
here and reaches the prefill agent only over that link (at 10.213.0.1). For each
rate and prompt length:

* TTFT: client-observed, from sending the request to the first token's arrival;
* compute: the prefill agent's own forward-pass time for the prompt;
* overhead = TTFT - compute: what the handoff (and everything else) adds;
* link time: the whole KV's bytes at the link's rate, i.e. what an unstreamed
  handoff would add after compute.

Bar: overhead <= 0.10 x compute wherever link time < compute (where the link is
slower than compute, the transfer cannot hide and the bar does not apply).
Needs root (namespaces, tc); without it the bench says so and skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.table import Table

from disagg.bench.common import (
    Pair,
    Say,
    disaggregated,
    long_text,
    need,
    pair_machine_info,
    quiet,
    table,
    verdict,
)

RATES: dict[str, float] = {"1gbit": 1e9, "10gbit": 10e9}  # bits per second
BURSTS = {"1gbit": "256kb", "10gbit": "2mb"}  # as the test bed shapes its links
LENGTHS = (128, 1024, 4096)
HIDING_BAR = 0.10
INNER, OUTER = "10.213.0.1", "10.213.0.2"  # prefill side, decode side (a /30)


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def cannot_run() -> str | None:
    """Why this machine cannot build the link, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [t for t in ("ip", "tc") if not shutil.which(t)]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


class Link:
    """A namespace for the prefill agent and a shaped veth pair to it."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns = f"disagg-hide-{tag}"
        self.dev = f"dgh{tag}"  # this side's end; the namespace's end is fast0
        self.rate = ""

    def up(self) -> None:
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "-n", self.ns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", self.dev, "type", "veth", "peer",
            "name", "fast0", "netns", self.ns)  # fmt: skip
        _sh("ip", "addr", "add", f"{OUTER}/30", "dev", self.dev)
        _sh("ip", "link", "set", self.dev, "up")
        _sh("ip", "-n", self.ns, "addr", "add", f"{INNER}/30", "dev", "fast0")
        _sh("ip", "-n", self.ns, "link", "set", "fast0", "up")

    def shape(self, rate: str) -> None:
        for where, dev in ((None, self.dev), (self.ns, "fast0")):
            netns = ["-n", where] if where else []
            _sh("tc", *netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", BURSTS[rate], "latency", "50ms")  # fmt: skip
        self.rate = rate

    def down(self) -> None:
        subprocess.run(["ip", "link", "del", self.dev], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


@contextmanager
def shaped_link() -> Iterator[Link]:
    link = Link()
    try:
        link.up()
        yield link
    finally:
        link.down()


def run_hiding_bench(
    model_dir: Path,
    *,
    lengths: tuple[int, ...] = LENGTHS,
    rates: tuple[str, ...] = tuple(RATES),
    repeats: int = 2,
    say: Say = quiet,
) -> dict[str, Any]:
    """Plain data; {"skipped": why} where the link cannot be built."""
    why = cannot_run()
    if why:
        return {"skipped": why}
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
    texts = {n: long_text(lambda s: len(tok.encode(s)), n) for n in lengths}
    rows: list[dict[str, Any]] = []
    with shaped_link() as link, split_pair(model_dir, link, say) as pair:
        once(pair, texts[min(lengths)])  # warm-up: connections, allocators, caches
        for rate in rates:
            link.shape(rate)
            for n in lengths:
                say(f"{rate}: {n}-token prompt x{repeats}")
                rows.append(hiding_row(rate, [once(pair, texts[n]) for _ in range(repeats)]))
        machine = pair_machine_info(*pair)
    applicable = [r for r in rows if r["bar_applies"]]
    return {
        "rates": list(rates),
        "lengths": list(lengths),
        "repeats": repeats,
        "bar": HIDING_BAR,
        "rows": rows,
        "ok": bool(applicable) and all(r["ok"] for r in applicable),
        "machine": machine,
        "note": (
            "prefill agent in its own network namespace behind a tbf-shaped veth pair "
            "(a copy of the test bed's fast link); median overhead of the repeats"
        ),
    }


@contextmanager
def split_pair(model_dir: Path, link: Link, say: Say) -> Iterator[Pair]:
    """The prefill agent in the link's namespace (at INNER), the decode agent here,
    one cluster token; stopped on the way out."""
    from disagg.serving.localagents import (
        AgentProc,
        make_token_file,
        spawn_agent,
        stop_agents,
        wait_ready,
    )

    logs = Path(tempfile.mkdtemp(prefix="disagg-hiding-"))
    token_file, token = make_token_file(logs)
    agents: list[AgentProc] = []
    say(f"starting the prefill agent in namespace {link.ns}, the decode agent here")
    try:
        for role, host, prefix in (
            ("prefill", INNER, ["ip", "netns", "exec", link.ns]),
            ("decode", "127.0.0.1", []),
        ):
            spawned = spawn_agent(
                role,
                model_dir,
                host=host,
                log_dir=logs / role,
                prefix=prefix,
                extra_args=["--token-file", str(token_file)],
            )
            agents.append(wait_ready(role, *spawned, timeout_s=300))
            agents[-1].token = token
        yield agents[0], agents[1]
    finally:
        stop_agents(agents)


def once(pair: Pair, text: str) -> dict[str, Any]:
    """One raw-KV handoff of `text`: client-observed TTFT against the prefill's compute."""
    req = {
        "prompt": text,
        "raw": True,
        "max_tokens": 1,
        "codec": 0,  # raw bytes: hiding the whole KV, not a compressed one
    }
    t0 = time.perf_counter()
    res, stamps = disaggregated(*pair, req, timeout_s=600)
    m = res.metrics
    ttft = stamps[0] - t0
    compute = float(need(m.prefill_time))
    return {
        "ttft_s": ttft,
        "compute_s": compute,
        "overhead_s": ttft - compute,
        "kv_bytes": int(need(m.kv_bytes)),
        "prompt_tokens": int(need(m.prompt_tokens)),
        "kv_link_gbit_s": (
            need(m.kv_link_bytes) * 8 / m.kv_link_time / 1e9 if m.kv_link_time else None
        ),
    }


def hiding_row(rate: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median overhead, against the bar where the link is faster than compute."""
    best = sorted(runs, key=lambda r: r["overhead_s"])[len(runs) // 2]
    link_s = best["kv_bytes"] * 8 / RATES[rate]
    applies = link_s < best["compute_s"]
    ratio = best["overhead_s"] / best["compute_s"]
    return {
        "rate": rate,
        **best,
        "link_time_s": link_s,
        "serial_estimate_s": best["compute_s"] + link_s,
        "overhead_over_compute": ratio,
        "bar_applies": applies,
        "ok": (ratio <= HIDING_BAR) if applies else None,
        "overheads_s": [r["overhead_s"] for r in runs],
    }


def hiding_table(report: dict[str, Any]) -> Table:
    if "skipped" in report:
        t = Table(title="Transfer hiding")
        t.add_column("skipped")
        t.add_row(report["skipped"])
        return t
    t = table(
        "Transfer hiding behind prefill compute (layer-wise streaming, raw KV)",
        (
            "link",
            "prompt tokens",
            "KV MB",
            "link time s",
            "compute s",
            "TTFT s",
            "TTFT - compute s",
            "/ compute",
            "unstreamed est. s",
            f"bar <= {report['bar']:.2f}",
        ),
        caption=report["note"],
    )
    for r in report["rows"]:
        mark = "n/a (link slower)" if not r["bar_applies"] else verdict(r["ok"])
        t.add_row(
            r["rate"],
            str(r["prompt_tokens"]),
            f"{r['kv_bytes'] / 1e6:.1f}",
            f"{r['link_time_s']:.3f}",
            f"{r['compute_s']:.3f}",
            f"{r['ttft_s']:.3f}",
            f"{r['overhead_s']:.3f}",
            f"{r['overhead_over_compute']:.3f}",
            f"{r['serial_estimate_s']:.3f}",
            mark,
        )
    return t

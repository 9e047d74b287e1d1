"""The grader's load (`disagg bench load`): disagg against mlx_lm.server.

Requests share one long rubric (the system message) and each carries a different
submission (the user message), as a grader sends them. For each concurrency level
`c` they arrive open-loop, at Poisson times of rate `c x rate` per second, and at most
`c` are in flight (a request that arrives to `c` in flight waits for a slot; that
wait is reported apart, TTFT counts from the send). A mixed run then sends short
questions and long unshared documents together at the highest level: the short
ones show whether a long prefill holds everybody up.

Both servers are real processes driven the same way (`disagg.bench.loadpeers`):
OpenAI's streaming /v1/chat/completions through httpx, greedy, `max_tokens` new
tokens (they may stop earlier at EOS). Measured client-side from the SSE chunks'
arrival times, per request: TTFT (send -> first answer text), TPOT ((last - first
chunk) / (completion tokens - 1), tokens from the server's usage), the longest
gap between two chunks of the stream; per run: p50/p99 over requests, the longest
gap of any stream, and completion tokens/s from the first send to the last end.
Each server gets one warm-up request first (the rubric's cold prefill, reported).
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from disagg.bench.common import Say, Stamp, cell, fitting_prefix, quiet, table
from disagg.bench.loadpeers import (
    Server,
    Streamed,
    attach_disagg,
    start_disagg,
    start_mlx_server,
    stream_chat,
)
from disagg.errors import AgentError


@dataclass(frozen=True)
class LoadSettings:
    """Sizes of the load. The defaults are the issue's grader: a ~3k-token rubric,
    ~300-token submissions, 1, 4 and 16 concurrent."""

    rubric_tokens: int = 3000
    submission_tokens: int = 300
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 2  # per concurrent slot: a level c sends max(c x requests, min_requests)
    min_requests: int = 4  # per level, so level 1 has a p50 worth the name
    rate: float = 0.5  # Poisson arrivals per second per concurrent slot
    new_tokens: int = 64
    mixed_requests: int = 8  # half short, half long; 0: no mixed run
    short_tokens: int = 32
    long_tokens: int = 0  # 0: rubric + submission tokens, unshared
    seed: int = 0
    peer: bool = True  # also run mlx_lm.server
    request_timeout_s: float = 900.0

    def per_level(self, c: int) -> int:
        return max(c * self.requests, self.min_requests)

    def check(self) -> None:
        if min(self.rubric_tokens, self.submission_tokens, self.short_tokens) < 8:
            raise ValueError("rubric, submission and short of at least 8 tokens")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency: levels of at least 1")
        if self.rate <= 0 or self.new_tokens < 2 or min(self.requests, self.min_requests) < 1:
            raise ValueError("rate > 0, tokens >= 2, requests and min_requests >= 1")
        if self.mixed_requests < 0 or self.long_tokens < 0 or self.request_timeout_s <= 0:
            raise ValueError("mixed >= 0, long >= 0, timeout > 0")


# A test's size: seconds of work once the servers are up.
QUICK = LoadSettings(
    rubric_tokens=64,
    submission_tokens=16,
    concurrency=(1, 2),
    requests=1,
    min_requests=1,
    rate=4.0,
    new_tokens=6,
    mixed_requests=2,
    short_tokens=8,
    long_tokens=80,
)
# The CLI's default: the shape at a third of its prompt lengths and half its
# new tokens, one request per slot (at least 4), so a CPU-only box finishes in minutes.
SMALL = LoadSettings(
    rubric_tokens=1000,
    submission_tokens=100,
    requests=1,
    new_tokens=32,
    mixed_requests=4,
)
PRESETS = {"quick": QUICK, "small": SMALL, "issue": LoadSettings()}
KEYS = {  # --sizes key -> LoadSettings field
    "rubric": "rubric_tokens",
    "submission": "submission_tokens",
    "concurrency": "concurrency",
    "requests": "requests",
    "min_requests": "min_requests",
    "rate": "rate",
    "tokens": "new_tokens",
    "mixed": "mixed_requests",
    "short": "short_tokens",
    "long": "long_tokens",
    "seed": "seed",
    "peer": "peer",
    "timeout": "request_timeout_s",
}


def parse_sizes(spec: str) -> LoadSettings:
    """`--sizes`: a preset (quick, small, issue) and/or key=value overrides,
    comma-separated: "issue", "small,requests=8", "rubric=3000,concurrency=1/4/16".
    Raises ValueError naming what is wrong."""
    base, fields = SMALL, {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if "=" not in part:
            if part not in PRESETS:
                raise ValueError(f"unknown preset {part!r} (one of {', '.join(PRESETS)})")
            base = PRESETS[part]
            continue
        key, _, value = (x.strip() for x in part.partition("="))
        if key not in KEYS:
            raise ValueError(f"unknown key {key!r} (one of {', '.join(KEYS)})")
        fields[KEYS[key]] = _value(key, value)
    settings = replace(base, **fields)
    settings.check()
    return settings


def _value(key: str, value: str) -> Any:
    try:
        if key == "concurrency":
            return tuple(int(v) for v in value.split("/"))
        if key == "peer":
            if value not in ("on", "off"):
                raise ValueError
            return value == "on"
        return float(value) if key in ("rate", "timeout") else int(value)
    except ValueError:
        hint = {"concurrency": "like 1/4/16", "peer": "on or off"}.get(key, "a number")
        raise ValueError(f"{key}={value!r}: expected {hint}") from None


# ---- deterministic text --------------------------------------------------------------

VOCABULARY = (
    "answer box coins shelf stones count lid red green blue amber violet grey step "
    "student opened found under each points award names the a of and if to in is it "
    "correct wrong partial full credit explain reason proof method result final value "
    "graph table list order first second third last sum total check unit label clear"
)
WORDS = tuple(VOCABULARY.split(" "))


def seeded_text(count: Callable[[str], int], tokens: int, seed: int, head: str = "") -> str:
    """`head` plus seeded random sentences: the longest word prefix of at most `tokens`
    tokens (by `count`). The same seed gives the same text."""
    rng = random.Random(seed)
    words = head.split(" ") if head else []
    for i in range(tokens * 2):  # a word is at least one token: more than enough
        if i % 12 == 11:
            words[-1] += "."
        words.append(rng.choice(WORDS) if i % 12 else rng.choice(WORDS).capitalize())
    return fitting_prefix(words, count, tokens)


@dataclass(frozen=True)
class Job:
    kind: str  # grader, short, long
    arrival_s: float
    messages: list[dict[str, str]]


class Workload:
    """The rubric, the submissions and the mixed run's prompts, from one seed."""

    def __init__(self, model_dir: Path, s: LoadSettings) -> None:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
        self.count: Callable[[str], int] = lambda text: len(tok.encode(text))
        self.s = s
        head = "You grade submissions against this rubric. Criterion 1:"
        self.rubric = seeded_text(self.count, s.rubric_tokens, s.seed, head)
        self.used = 0  # every request gets a fresh submission: only the rubric is shared

    def grader(self) -> list[dict[str, str]]:
        self.used += 1
        head = f"Submission {self.used}:"
        seed = self.s.seed * 7919 + self.used
        sub = seeded_text(self.count, self.s.submission_tokens, seed, head)
        return [{"role": "system", "content": self.rubric}, {"role": "user", "content": sub}]

    def alone(self, kind: str) -> list[dict[str, str]]:
        self.used += 1
        n = self.s.short_tokens if kind == "short" else self.long_tokens
        head = f"Question {self.used}:" if kind == "short" else f"Document {self.used}:"
        seed = self.s.seed * 7919 + self.used + 104729
        return [{"role": "user", "content": seeded_text(self.count, n, seed, head)}]

    @property
    def long_tokens(self) -> int:
        return self.s.long_tokens or self.s.rubric_tokens + self.s.submission_tokens


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """`n` Poisson arrival times at `rate` per second, the first at 0."""
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ---- a run ------------------------------------------------------------------------------


def run_jobs(server: Server, jobs: list[Job], c: int, s: LoadSettings) -> list[Streamed]:
    """Each job sent at its arrival time once fewer than `c` are in flight; all streamed."""
    import httpx

    slots = threading.Semaphore(c)
    records = [Streamed(j.kind, j.arrival_s) for j in jobs]
    timeout = httpx.Timeout(s.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    with httpx.Client(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        def one(job: Job, rec: Streamed) -> None:
            time.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
            with slots:
                try:
                    stream_chat(client, server, job.messages, s.new_tokens, rec, t0)
                except Exception as e:  # counted as failed, never lost in a thread
                    rec.error = f"{type(e).__name__}: {e}"

        threads = [
            threading.Thread(target=one, args=(j, r), daemon=True)
            for j, r in zip(jobs, records, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return records


def pct(xs: list[float]) -> tuple[float | None, float | None]:
    """p50 and p99 (linear interpolation; with few requests p99 is near the max)."""
    if not xs:
        return None, None
    p50, p99 = np.percentile(np.asarray(xs, dtype=float), [50, 99])
    return float(p50), float(p99)


def summarize(records: list[Streamed]) -> dict[str, Any]:
    """The run's figures from its streams (completed ones; errors counted and listed)."""
    done = [r for r in records if r.error is None]
    ttft = [r.stamps[0] - r.sent_s for r in done]
    tpot = [
        (r.stamps[-1] - r.stamps[0]) / (r.completion_tokens - 1)
        for r in done
        if r.completion_tokens > 1 and len(r.stamps) > 1
    ]
    gaps = [float(np.diff(r.stamps).max()) for r in done if len(r.stamps) > 1]
    waits = [r.sent_s - r.arrival_s for r in records]
    tokens = sum(r.completion_tokens for r in done)
    span = max((r.end_s for r in done), default=0.0) - min((r.sent_s for r in records), default=0.0)
    (ttft50, ttft99), (tpot50, tpot99), (wait50, wait99) = pct(ttft), pct(tpot), pct(waits)
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": [r.error for r in records if r.error is not None],
        "ttft_p50_s": ttft50,
        "ttft_p99_s": ttft99,
        "tpot_p50_s": tpot50,
        "tpot_p99_s": tpot99,
        "max_gap_s": max(gaps, default=None),
        "slot_wait_p50_s": wait50,
        "slot_wait_p99_s": wait99,
        "completion_tokens": tokens,
        "completion_tokens_mean": tokens / len(done) if done else None,
        "cached_tokens_mean": (sum(r.cached_tokens for r in done) / len(done)) if done else None,
        "prompt_tokens_mean": (sum(r.prompt_tokens for r in done) / len(done)) if done else None,
        "wall_s": span,
        "tokens_per_s": tokens / span if span > 0 else None,
        "requests_per_s": len(done) / span if span > 0 else None,
    }


def per_request(records: list[Streamed]) -> list[dict[str, Any]]:
    """Each request in short: kind, arrival, wait for a slot, TTFT, tokens, longest gap."""
    return [
        {
            "kind": r.kind,
            "arrival_s": round(r.arrival_s, 3),
            "wait_s": round(r.sent_s - r.arrival_s, 3),
            "ttft_s": round(r.stamps[0] - r.sent_s, 3) if r.stamps else None,
            "tokens": r.completion_tokens,
            "max_gap_s": round(float(np.diff(r.stamps).max()), 3) if len(r.stamps) > 1 else None,
            "error": r.error,
        }
        for r in records
    ]


# ---- the bench ----------------------------------------------------------------------------


def run_load_bench(
    model_dir: Path,
    settings: LoadSettings = LoadSettings(),
    *,
    log_dir: Path | None = None,
    say: Say = quiet,
    url: str | None = None,
) -> dict[str, Any]:
    """Every level (and the mixed run) on disagg, then on mlx_lm.server; plain data.
    The servers run one after the other, so neither takes CPU from the other. With
    `url`, disagg is the gateway running there (a fleet's `disagg serve`), not a
    `disagg serve --local` started here."""
    s = settings
    s.check()
    model_dir = Path(model_dir)
    stamp = Stamp()
    logs = Path(log_dir or tempfile.mkdtemp(prefix="disagg-load-"))
    logs.mkdir(parents=True, exist_ok=True)
    say("tokenizing the rubric and submissions")
    work = Workload(model_dir, s)
    plan = _plan(work, s)
    servers: dict[str, Any] = {}
    ours = start_disagg if url is None else lambda m, _logs: attach_disagg(url, m)
    starters = [("disagg", ours)] + ([("mlx_lm", start_mlx_server)] if s.peer else [])
    for key, start in starters:
        say(f"{key}: starting the server")
        try:
            server = start(model_dir, logs)
        except AgentError as e:
            if key == "disagg":
                raise
            # The peer is optional: its figures are missing, ours still count.
            say(f"{key}: could not start, no peer figures (peer=off skips it): {e}")
            servers[key] = {"error": str(e)}
            continue
        try:
            servers[key] = _bench_one(server, plan, s, say)
        finally:
            server.stop()
    return {
        "date": stamp.date,
        "model": str(model_dir),
        "settings": {**asdict(s), "concurrency": list(s.concurrency)},
        "method": (
            "client-side: streamed POST /v1/chat/completions (httpx), greedy; disagg through "
            f"its OpenAI gateway ({url or 'disagg serve --local'}), mlx_lm.server on the same "
            "model dir and BLAS; TTFT from the send, TPOT = (last - first chunk) / (tokens - 1)"
        ),
        "rubric_tokens": work.count(work.rubric),
        "servers": servers,
        "url": url,
        "logs": str(logs),
        "load_avg_1m": stamp.load_avg_1m(),
        "elapsed_s": stamp.elapsed_s(),
    }


def _plan(work: Workload, s: LoadSettings) -> dict[str, Any]:
    """The same jobs (prompts and arrival times) for both servers."""
    rng = random.Random(s.seed)
    plan: dict[str, Any] = {"warmup": Job("grader", 0.0, work.grader()), "levels": []}
    for c in s.concurrency:
        n = s.per_level(c)
        times = arrivals(n, c * s.rate, rng)
        plan["levels"].append((c, [Job("grader", t, work.grader()) for t in times]))
    if s.mixed_requests:
        c = max(s.concurrency)
        kinds = ["short", "long"] * (s.mixed_requests // 2) + ["short"] * (s.mixed_requests % 2)
        rng.shuffle(kinds)
        times = arrivals(len(kinds), c * s.rate, rng)
        plan["mixed"] = (c, [Job(k, t, work.alone(k)) for k, t in zip(kinds, times, strict=True)])
    return plan


def _bench_one(server: Server, plan: dict[str, Any], s: LoadSettings, say: Say) -> dict[str, Any]:
    stamp = Stamp()  # the machine is shared: each server's own load average
    out: dict[str, Any] = {"name": server.name, "start_s": server.started_s}
    out["log"] = str(server.log_path)
    say(f"{server.name}: warm-up request (the rubric's cold prefill)")
    warm = run_jobs(server, [plan["warmup"]], 1, s)
    out["warmup"] = summarize(warm)
    out["levels"] = []
    for c, jobs in plan["levels"]:
        say(f"{server.name}: {len(jobs)} grader requests, at most {c} in flight")
        recs = run_jobs(server, jobs, c, s)
        row = summarize(recs)
        out["levels"].append({"concurrency": c, **row, "per_request": per_request(recs)})
        say(_line(row))
    if "mixed" in plan:
        c, jobs = plan["mixed"]
        say(f"{server.name}: mixed run, {len(jobs)} short and long prompts, {c} in flight")
        recs = run_jobs(server, jobs, c, s)
        out["mixed"] = {
            "concurrency": c,
            "all": summarize(recs),
            "short": summarize([r for r in recs if r.kind == "short"]),
            "long": summarize([r for r in recs if r.kind == "long"]),
            "per_request": per_request(recs),
        }
        say(_line(out["mixed"]["all"]))
    out["load_avg_1m"] = stamp.load_avg_1m()
    out["elapsed_s"] = stamp.elapsed_s()
    return out


def _line(row: dict[str, Any]) -> str:
    return (
        f"  {row['completed']}/{row['requests']} done, TTFT p50 {cell(row['ttft_p50_s'])} s, "
        f"TPOT p50 {cell(row['tpot_p50_s'], 1e3, '{:.0f}')} ms, "
        f"{cell(row['tokens_per_s'], form='{:.1f}')} tok/s"
    )


# ---- tables -------------------------------------------------------------------------------

SERVERS = (("disagg", "disagg"), ("mlx_lm", "mlx_lm.server"))
COLUMNS = (
    "run",
    "server",
    "done",
    "TTFT p50 / p99 s",
    "TPOT p50 / p99 ms",
    "longest gap s",
    "tok/s",
    "slot wait p99 s",
    "cached tok",
)


def _cells(row: dict[str, Any]) -> list[str]:
    done = f"{row['completed']}/{row['requests']}"
    if row["errors"]:
        done = f"[red]{done}[/]"
    return [
        done,
        f"{cell(row['ttft_p50_s'], form='{:.2f}')} / {cell(row['ttft_p99_s'], form='{:.2f}')}",
        f"{cell(row['tpot_p50_s'], 1e3, '{:.0f}')} / {cell(row['tpot_p99_s'], 1e3, '{:.0f}')}",
        cell(row["max_gap_s"], form="{:.2f}"),
        cell(row["tokens_per_s"], form="{:.1f}"),
        cell(row["slot_wait_p99_s"], form="{:.1f}"),
        cell(row["cached_tokens_mean"], form="{:.0f}"),
    ]


def _errors(servers: dict[str, Any], ran: list[tuple[str, str]]) -> list[str]:
    """One line per run with failed requests: how many, and each distinct error once."""
    lines = []
    for key, label in ran:
        srv = servers[key]
        named = [("warm-up", srv["warmup"])]
        named += [(f"{lv['concurrency']} concurrent", lv) for lv in srv["levels"]]
        named += [("mixed", srv["mixed"]["all"])] if "mixed" in srv else []
        for run, row in named:
            if row["errors"]:
                first = "; ".join(sorted(set(row["errors"])))[:300]
                lines.append(f"{label} {run}: {len(row['errors'])} failed: {first}")
    return lines


def load_table(report: dict[str, Any]) -> Table:
    s, servers = report["settings"], report["servers"]
    ran = [(k, label) for k, label in SERVERS if k in servers and "error" not in servers[k]]
    missing = [
        f"{label}: {servers[k]['error']}" for k, label in SERVERS if "error" in servers.get(k, {})
    ]
    t = table(
        f"Grader load: {report['rubric_tokens']}-token rubric + ~{s['submission_tokens']}-token "
        f"submissions, up to {s['new_tokens']} new tokens, Poisson arrivals at "
        f"{s['rate']:g}/s per slot",
        COLUMNS,
        left=("run", "server"),
        caption=" · ".join(
            [
                report["date"],
                f"load avg (1 min) {report['load_avg_1m']['start']} -> "
                f"{report['load_avg_1m']['end']}",
                report["method"],
                *missing,
                *_errors(servers, ran),
            ]
        ),
    )
    for key, label in ran:
        t.add_row("warm-up (cold rubric)", label, *_cells(servers[key]["warmup"]))
    for i, level in enumerate(servers["disagg"]["levels"]):
        for key, label in ran:
            run = f"{level['concurrency']} concurrent"
            t.add_row(run, label, *_cells(servers[key]["levels"][i]))
    for part in ("short", "long", "all"):
        for key, label in ran:
            mixed = servers[key].get("mixed")
            if mixed:
                run = f"mixed, {mixed['concurrency']} conc.: {part}"
                t.add_row(run, label, *_cells(mixed[part]))
    return t

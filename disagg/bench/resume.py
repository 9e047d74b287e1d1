"""What the disk tier and migration buy, timed on real local agents
(`python -m disagg.bench.resume --model DIR`; the numbers in docs/performance.md).

1. TTFT of one long raw prompt, prefilled remotely and locally: cold
   (`prefix_cache: false`: every position computed and sent), from the decode
   agent's memory tier (the same prompt again), after a decode agent restart from
   its disk tier (`--prefix-disk`), and after a restart without it (the prefill
   agent's own cache still warm).
2. A migrated stream: two decode agents, the serving one SIGKILLed after
   `--kill-at` tokens; the result's `resume_time` (failure noticed to the next
   agent's first token) against the request's TTFT.

Prints one JSON object; plain data, no thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from disagg.serving.localagents import AgentProc, restart_agent, start_local_agents, stop_agents
from disagg.serving.router import Endpoint, Route, Router
from disagg.serving.wireclient import generate
from disagg_agents.wire.answer import TokenEvent
from disagg_agents.wire.request import GenerateRequest

WORDS = [
    "the",
    "key",
    "value",
    "cache",
    "of",
    "every",
    "layer",
    "streams",
    "over",
    "a",
    "raw",
    "TCP",
    "socket",
    "from",
    "one",
    "machine",
    "to",
    "another",
    "while",
    "the",
    "decode",
    "agent",
    "keeps",
    "the",
    "prompt",
    "in",
    "blocks",
    "on",
    "its",
    "local",
    "disk",
]


def prompt_of(n_words: int) -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]}{i % 97}" for i in range(n_words))


def ask(decode: AgentProc, prefill: AgentProc, req: GenerateRequest) -> dict[str, Any]:
    target = Endpoint(prefill.name, prefill.host, prefill.port).prefill_target(None, "none")
    t0 = time.perf_counter()
    r = generate(decode.host, decode.port, req.replace(prefill=target), token=decode.token)
    m = r.metrics
    return {
        "ttft_s": round(m.ttft or 0.0, 4),
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "disk_cached_tokens": m.disk_cached_tokens,
        "prefill_cached_tokens": m.prefill_cached_tokens,
        "kv_bytes": m.kv_bytes,
        "total_s": round(time.perf_counter() - t0, 4),
        "tokens": r.token_ids,
    }


def ttft_rows(model: Path, n_words: int, disk: Path, placement: str) -> dict[str, Any]:
    args = ["--prefix-disk", str(disk), "--prefix-disk-mb", "4096"]
    prefill, (decode,) = start_local_agents(model, n_decode=1, decode_args=args)
    agents = [prefill, decode]
    try:
        req = GenerateRequest(
            prompt=prompt_of(n_words), raw=True, max_tokens=4, placement=placement
        )
        rows: dict[str, Any] = {"cold": ask(decode, prefill, req.replace(prefix_cache=False))}
        ask(decode, prefill, req)  # fills the memory tier (and writes the disk tier)
        rows["memory"] = ask(decode, prefill, req)
        time.sleep(2.0)  # the disk writes are async
        decode.stop()
        agents[1] = decode = restart_agent(decode)
        rows["restart_disk"] = ask(decode, prefill, req)
        decode.settings(prefix_disk_mb=0)  # empties it: the next restart finds nothing
        decode.stop()
        agents[1] = decode = restart_agent(decode)
        rows["restart_no_disk"] = ask(decode, prefill, req)
        same = {
            k: v.pop("tokens") == rows["cold"]["tokens"] for k, v in rows.items() if k != "cold"
        }
        rows["cold"].pop("tokens")
        return {"rows": rows, "same_tokens_as_cold": same}
    finally:
        stop_agents(agents)


def migration_row(model: Path, n_words: int, kill_at: int) -> dict[str, Any]:
    prefill, decodes = start_local_agents(model, n_decode=2)
    try:
        eps = [Endpoint(d.name, d.host, d.port, d.control_port) for d in decodes]
        p = Endpoint(prefill.name, prefill.host, prefill.port, prefill.control_port)
        router = Router([Route("m", [p], eps, integrity="none")], token=prefill.token)
        req = GenerateRequest(
            prompt=prompt_of(n_words), raw=True, max_tokens=kill_at + 64, ignore_eos=True,
            placement="remote",
        )  # fmt: skip
        seen: list[int] = []
        serving: list[str] = []

        def on_token(t: TokenEvent) -> None:
            if t.metrics is not None and not serving:
                serving.append(str(t.metrics.decode_server))
            if t.id is not None:
                seen.append(t.id)
                if len(seen) == kill_at:
                    victim = next(d for d in decodes if d.name == serving[0])
                    os.kill(victim.proc.pid, signal.SIGKILL)

        r = router.run("m", req, on_token=on_token)
        m = r.metrics
        return {
            "prompt_tokens": m.prompt_tokens,
            "ttft_s": round(m.ttft or 0.0, 4),
            "resume_time_s": round(m.resume_time or 0.0, 4),
            "resumed_tokens": m.resumed_tokens,
            "migrations": m.migrations,
            "tokens": len(r.token_ids),
        }
    finally:
        stop_agents([prefill, *decodes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument(
        "--words", type=int, default=3000, help="prompt length in words (~5 tokens each)"
    )
    ap.add_argument("--kill-at", type=int, default=32)
    a = ap.parse_args()
    out: dict[str, Any] = {}
    for placement in ("remote", "local"):
        with tempfile.TemporaryDirectory(prefix="disagg-disk-bench-") as d:
            out[f"ttft_{placement}"] = ttft_rows(a.model, a.words, Path(d), placement)
    out["migration"] = migration_row(a.model, a.words, a.kill_at)
    out["migration_short"] = migration_row(a.model, 200, a.kill_at)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""`disagg generate --local` beside two busy processes, per thread setting: does the
default collapse where other work holds the cores? A benchmark, not a test.

    python scripts/bench_busy_threads.py [--rounds 2] [--tokens 32]

Starts two spinning processes (one per core of a 2-core box), then runs each setting
once per round, in a fresh order each round (interleaved: the machine's other load
drifts), and prints per setting the medians of the request's time (ttft + decode),
TTFT, decode tok/s and the command's wall time, and each against the best setting.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "OMP=1 OPENBLAS=1": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    # the default until the decode agent watched the machine: OpenBLAS on every core
    "DISAGG_BLAS_WATCH=0": {"DISAGG_BLAS_WATCH": "0"},
}
CLEARED = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "DISAGG_BLAS_WATCH")
PROMPT = "Write a short paragraph about lighthouses."


def spin() -> None:
    while True:
        pass


def one(setting: dict[str, str], tokens: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(setting)
    cmd = [sys.executable, "-m", "disagg.cli", "generate", "--local", "--json"]
    t0 = time.monotonic()
    done = subprocess.run(
        [*cmd, "-n", str(tokens), "-t", "0", PROMPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=True,
    )
    wall = time.monotonic() - t0
    m = json.loads(done.stdout)["metrics"]
    return {
        "request_s": (m["ttft"] or 0) + (m["decode_time"] or 0),
        "ttft_s": m["ttft"],
        "prefill_s": m["prefill_time"],
        "tok_per_s": m["decode_speed"],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--busy", type=int, default=2, help="spinning processes beside it")
    args = ap.parse_args()
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    try:
        for r in range(args.rounds):
            order = list(SETTINGS)
            random.shuffle(order)
            for name in order:
                got = one(SETTINGS[name], args.tokens)
                runs[name].append(got)
                print(f"round {r + 1} {name}: {json.dumps(got)}", file=sys.stderr, flush=True)
    finally:
        for p in spinners:
            p.terminate()
    med = {
        name: {k: statistics.median(x[k] for x in rs if x[k] is not None) for k in rs[0]}
        for name, rs in runs.items()
    }
    best = min(v["request_s"] for v in med.values())
    load = os.getloadavg()[0]
    print(
        f"{args.busy} busy processes, {args.rounds} rounds, {args.tokens} tokens, load {load:.1f}"
    )
    print("| setting | request s (ttft+decode) | × best | TTFT s | prefill s | tok/s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, v in med.items():
        print(
            f"| {name} | {v['request_s']:.2f} | {v['request_s'] / best:.2f} | {v['ttft_s']:.2f} "
            f"| {v['prefill_s']:.2f} | {v['tok_per_s']:.2f} | {v['wall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()

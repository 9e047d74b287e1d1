"""CPU prefill tokens/s of a MoE checkpoint: this tree against an older one, interleaved.

    python -m disagg.bench.moeprefill --old /path/to/older/worktree [--model DIR]

Each measurement is a fresh process (PYTHONPATH at one tree) that loads
`PrefillEngine(model, device="cpu")`, prefills once to warm up, then times `repeats`
prefills of each prompt length and prints their median. Variants run in turn, their
order rotated every round, so a busy machine slows both alike. Variants: `old`
(the other tree), `new` (this tree, weights as the memory budget allows: kept
dequantized here), `new-packed` (this tree, DISAGG_DEQUANT_BUDGET_GB=0).
Default model: the tests' tiny qwen3_moe at 128 experts, top-8, MLX affine 4-bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBE = """
import json, statistics, sys, time
try:
    from disagg_agents.prefill.engine import PrefillEngine
except ImportError:  # a tree from before agents/ was grouped by process
    from disagg_agents.prefill import PrefillEngine
model, lengths, repeats = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
eng = PrefillEngine(model, device="cpu")
vocab = int(eng.cfg["vocab_size"])
out = {}
for n in lengths:
    ids = [(i * 7919 + 13) % vocab for i in range(n)]
    eng.prefill(ids, lambda kv: None)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        eng.prefill(ids, lambda kv: None)
        times.append(time.perf_counter() - t)
    out[n] = n / statistics.median(times)
print(json.dumps(out))
"""
HERE = Path(__file__).resolve().parents[2]


def measure(
    tree: Path, model: str, lengths: list[int], repeats: int, env: dict[str, str]
) -> dict[int, float]:
    """{tokens: tokens/s} from one fresh process on `tree`."""
    full = {**os.environ, "PYTHONPATH": str(tree), **env}
    cmd = [sys.executable, "-c", PROBE, model, ",".join(map(str, lengths)), str(repeats)]
    done = subprocess.run(cmd, cwd=tree, env=full, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr.strip().splitlines()[-1:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def run(old: Path, model: str, lengths: list[int], rounds: int, repeats: int) -> dict[str, Any]:
    variants = {
        "old": (old, {}),
        "new": (HERE, {}),
        "new-packed": (HERE, {"DISAGG_DEQUANT_BUDGET_GB": "0"}),
    }
    names = list(variants)
    rates: dict[str, list[dict[int, float]]] = {v: [] for v in names}
    for r in range(rounds):
        for v in names[r % len(names) :] + names[: r % len(names)]:
            tree, env = variants[v]
            rates[v].append(measure(tree, model, lengths, repeats, env))
            print(f"round {r + 1}/{rounds} {v}: {rates[v][-1]}", file=sys.stderr)
    summary = {}
    for n in lengths:
        med = {v: statistics.median(x[n] for x in rates[v]) for v in names}
        pairs = [new[n] / o[n] for new, o in zip(rates["new"], rates["old"], strict=True)]
        summary[n] = {
            "tokens_per_s": med,
            "new_over_old": med["new"] / med["old"],
            "new_over_old_per_round": pairs,
            "packed_over_old": med["new-packed"] / med["old"],
        }
    return {"model": model, "rounds": rounds, "repeats": repeats, "lengths": summary, "runs": rates}


def default_model() -> str:
    sys.path.insert(0, str(HERE))
    from tests.quantmodels import quant_dir

    return str(quant_dir("moe128-affine4"))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", type=Path, required=True, help="the older worktree")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", default="256,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = a.model or default_model()
    lengths = [int(n) for n in a.tokens.split(",")]
    print(json.dumps(run(a.old, model, lengths, a.rounds, a.repeats), indent=2))


if __name__ == "__main__":
    main()

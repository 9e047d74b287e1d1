"""Many requests at once across pipelines: a JSONL file, or one prompt on several models."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from agents.request import GenerateRequest
from disagg.api import Client, Completion
from disagg.errors import DisaggError, UsageError
from disagg.serving.request import build_request

# A line holds a request's fields, plus which model runs it and an id for the results.
REQUEST_KEYS = {f.name for f in fields(GenerateRequest)} - {"prefill"} | {"model", "id"}


@dataclass
class BatchResult:
    results: list[dict[str, Any]]
    wall_time: float
    sum_time: float

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r.get("error"))


def load_requests(path: Path) -> list[dict[str, Any]]:
    """Parse a JSONL file of requests; errors name the line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read --batch file {path}: {e.strerror}") from None
    reqs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not (obj.get("prompt") or obj.get("messages")):
            raise UsageError(f"{path}:{n}: each line needs a JSON object with prompt or messages")
        unknown = set(obj) - REQUEST_KEYS
        if unknown:
            raise UsageError(f"{path}:{n}: unknown keys {sorted(unknown)}")
        try:
            build_request(**{k: v for k, v in obj.items() if k not in ("model", "id")})
        except UsageError as e:
            raise UsageError(f"{path}:{n}: {e}") from None
        obj.setdefault("id", n)
        reqs.append(obj)
    if not reqs:
        raise UsageError(f"{path} holds no requests")
    return reqs


def run_batch(
    client: Client,
    requests: list[dict[str, Any]],
    defaults: dict[str, Any],
    concurrency: int = 16,
    on_done: Callable[[dict[str, Any]], None] = lambda _r: None,
) -> BatchResult:
    """Run all requests concurrently (at most `concurrency` at a time)."""

    def one(req: dict[str, Any]) -> dict[str, Any]:
        args = {**defaults, **{k: v for k, v in req.items() if k != "id"}}
        t0 = time.perf_counter()
        try:
            c = client.generate(**args)
            assert isinstance(c, Completion)
            row: dict[str, Any] = {
                "id": req["id"],
                "model": c.model,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "metrics": c.metrics,
            }
        except DisaggError as e:
            row = {"id": req["id"], "model": args.get("model"), "error": str(e)}
        row["time"] = time.perf_counter() - t0
        return row

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(requests)))) as pool:
        futures = [pool.submit(one, r) for r in requests]
        for fut in as_completed(futures):
            rows.append(fut.result())
            on_done(rows[-1])
    wall = time.perf_counter() - t0
    order = {r["id"]: i for i, r in enumerate(requests)}
    rows.sort(key=lambda r: order[r["id"]])
    return BatchResult(rows, wall, sum(r["time"] for r in rows))

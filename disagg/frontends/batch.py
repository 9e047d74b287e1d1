"""Many requests at once across pipelines: a JSONL file, or one prompt on several models."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from disagg.api import Client, Completion
from disagg.errors import DisaggError, UsageError
from disagg.serving.checkedrequest import build_request
from disagg_agents.wire.request import GenerateRequest

# A line holds a request's fields, plus which model runs it and an id for the results.
REQUEST_KEYS = {f.name for f in fields(GenerateRequest)} - {"prefill"} | {"model", "id"}


@dataclass(frozen=True)
class BatchItem:
    """One line of a batch: the request, the model that runs it, and its id."""

    id: Any
    model: str | None
    request: GenerateRequest


@dataclass
class BatchResult:
    results: list[dict[str, Any]]
    wall_time: float
    sum_time: float

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r.get("error"))


def parse_line(obj: Any, n: int, defaults: dict[str, Any]) -> BatchItem:
    """A batch line as a request: the line's fields over `defaults` (the CLI's options)."""
    if not isinstance(obj, dict) or not (obj.get("prompt") or obj.get("messages")):
        raise UsageError("each line needs a JSON object with prompt or messages")
    unknown = set(obj) - REQUEST_KEYS
    if unknown:
        raise UsageError(f"unknown keys {sorted(unknown)}")
    fields = {k: v for k, v in obj.items() if k not in ("model", "id")}
    return BatchItem(obj.get("id", n), obj.get("model"), build_request(**{**defaults, **fields}))


def load_requests(path: Path, defaults: dict[str, Any] | None = None) -> list[BatchItem]:
    """Parse a JSONL file of requests; errors name the line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read --batch file {path}: {e.strerror}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            items.append(parse_line(json.loads(line), n, defaults or {}))
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except UsageError as e:
            raise UsageError(f"{path}:{n}: {e}", param=e.param) from None
    if not items:
        raise UsageError(f"{path} holds no requests")
    return items


def run_batch(
    client: Client,
    items: list[BatchItem],
    default_model: str | None = None,
    concurrency: int = 16,
    on_done: Callable[[dict[str, Any]], None] = lambda _r: None,
) -> BatchResult:
    """Run all requests concurrently (at most `concurrency` at a time)."""

    def one(item: BatchItem) -> dict[str, Any]:
        model = item.model or default_model
        t0 = time.perf_counter()
        try:
            c = client.generate(item.request, model=model)
            assert isinstance(c, Completion)
            row: dict[str, Any] = {
                "id": item.id,
                "model": c.model,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "metrics": c.metrics.to_json(),
            }
        except DisaggError as e:
            row = {"id": item.id, "model": model, "error": str(e)}
        row["time"] = time.perf_counter() - t0
        return row

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(items)))) as pool:
        futures = [pool.submit(one, item) for item in items]
        for fut in as_completed(futures):
            rows.append(fut.result())
            on_done(rows[-1])
    wall = time.perf_counter() - t0
    order = {item.id: i for i, item in enumerate(items)}
    rows.sort(key=lambda r: order[r["id"]])
    return BatchResult(rows, wall, sum(r["time"] for r in rows))

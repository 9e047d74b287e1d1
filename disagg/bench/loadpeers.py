"""The two servers `disagg bench load` drives, and the one client it drives them with.

Both are real processes on 127.0.0.1 that speak OpenAI's streaming chat API:
`disagg serve --local` (its gateway over a local prefill + decode agent pair) and
`mlx_lm.server` (continuous batching and a prompt cache, the peer a Mac user would
pick). mlx_lm.server runs with the same BLAS as the decode agent (`disagg_agents.runtime.fastblas`):
mlx's Linux wheel bundles a reference BLAS that a Mac never uses.

`stream_chat` sends one streamed request with httpx and stamps each SSE chunk that
carries answer text as it arrives; the figures are computed from those stamps the
same way for both servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from disagg.errors import AgentError
from disagg.serving.localagents import free_port
from disagg_agents.wire.text import printable

MLX_SERVER = (
    "import sys\n"
    "import disagg_agents.runtime.fastblas  # the decode agent's BLAS, before mlx loads\n"
    "from mlx_lm.server import main\n"
    "sys.argv[0] = 'mlx_lm.server'\n"
    "main()\n"
)


@dataclass
class Server:
    """A server process and where its OpenAI API answers."""

    name: str
    proc: subprocess.Popen[bytes] | None  # None: a running server we were given (--url)
    url: str
    model: str
    log_path: Path | None
    started_s: float = 0.0  # seconds from launch until /v1/models answered

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # disagg serve stops its agents on SIGTERM
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _launch(name: str, cmd: list[str], log_path: Path, model: str | None, wait_s: float) -> Server:
    """Start `cmd`, wait until it answers on its port (the last argument): GET /health,
    then /v1/models for the model's name unless `model` is given (mlx_lm.server's
    /v1/models scans the Hugging Face cache and fails without one)."""
    port = int(cmd[-1])
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(name, proc, url, model or "", log_path)
    t0 = time.perf_counter()
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    if not server.model:
                        models = httpx.get(f"{url}/v1/models", timeout=5).json()
                        server.model = models["data"][0]["id"]
                    server.started_s = time.perf_counter() - t0
                    return server
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > wait_s:
                lines = log_path.read_text(errors="replace").splitlines()
                tail = "\n".join([x for x in lines if "GET /health" not in x][-8:])
                raise AgentError(f"{name} did not start (log {log_path}):\n{tail}")
            time.sleep(0.5)
    except BaseException:  # Ctrl-C included: never leave the process behind
        server.stop(grace_s=5.0)
        raise


def start_disagg(model_dir: Path, log_dir: Path, wait_s: float = 600.0) -> Server:
    """`disagg serve --local -m DIR`: the gateway and one prefill + decode agent pair."""
    cmd = [sys.executable, "-m", "disagg.cli", "serve", "--local", "-m", str(model_dir)]
    cmd += ["--port", str(free_port())]
    return _launch("disagg", cmd, log_dir / "disagg-serve.log", None, wait_s)


def attach_disagg(url: str, model_dir: Path, wait_s: float = 10.0) -> Server:
    """A running `disagg serve` at `url` (a fleet's gateway): its model named as
    `model_dir` is, else its only one. AgentError saying what is wrong."""
    url = url.rstrip("/")
    try:
        httpx.get(f"{url}/health", timeout=wait_s).raise_for_status()
        ids = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=wait_s).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise AgentError(f"no disagg gateway answers at {url}: {printable(e, 200)}") from None
    if model_dir.name in ids:
        return Server("disagg", None, url, model_dir.name, None)
    if len(ids) == 1:
        return Server("disagg", None, url, ids[0], None)
    shown = ", ".join(printable(i, 80) for i in ids[:8]) or "none"
    raise AgentError(f"the gateway at {url} serves no model named {model_dir.name!r} ({shown})")


def start_mlx_server(model_dir: Path, log_dir: Path, wait_s: float = 600.0) -> Server:
    """`python -m mlx_lm.server --model DIR` with its defaults: continuous batching
    (--decode-concurrency 32, --prompt-concurrency 8) and a prompt cache of 10
    entries that keeps a chat's system-message prefix."""
    cmd = [sys.executable, "-c", MLX_SERVER, "--model", str(model_dir), "--log-level", "WARNING"]
    cmd += ["--port", str(free_port())]
    return _launch("mlx_lm.server", cmd, log_dir / "mlx-lm-server.log", "default_model", wait_s)


@dataclass
class Streamed:
    """One request as the client saw it; times in seconds on the run's clock."""

    kind: str  # "grader", "short" or "long"
    arrival_s: float  # when it arrived (Poisson schedule)
    sent_s: float = 0.0  # when it was sent (a concurrency slot was free)
    stamps: list[float] = field(default_factory=list)  # each chunk with answer text
    end_s: float = 0.0
    completion_tokens: int = 0  # the server's usage, else the chunks counted
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def stream_chat(
    client: httpx.Client,
    server: Server,
    messages: list[dict[str, str]],
    max_tokens: int,
    out: Streamed,
    t0: float,
) -> Streamed:
    """POST a streamed, greedy chat completion and fill `out` from its SSE chunks."""
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out.sent_s = time.perf_counter() - t0
    usage: dict[str, Any] | None = None
    try:
        with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                event = json.loads(line[6:])
                if "error" in event:  # OpenAI's error object, sent mid-stream
                    err = event["error"]
                    out.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    break
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        out.stamps.append(now)
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a chunk that is not JSON
        out.error = f"{type(e).__name__}: {e}"
    out.end_s = time.perf_counter() - t0
    if usage:
        out.completion_tokens = int(usage.get("completion_tokens") or 0)
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = int(details.get("cached_tokens") or 0)
    else:
        out.completion_tokens = len(out.stamps)
    if out.error is None and not out.stamps:
        out.error = "the stream ended without any answer text"
    return out

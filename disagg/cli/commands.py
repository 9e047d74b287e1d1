"""The commands that run models: generate, serve, verify (the benches: `disagg.cli.bench`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from disagg.cli.common import (
    AllowMixed,
    Dtype,
    Inventory,
    Json,
    Local,
    Model,
    Models,
    PrefillModel,
    PrefixDisk,
    PrefixDiskMb,
    app,
    err,
    friendly,
    need_local,
    out,
    say,
)
from disagg.errors import UsageError


def _serve_keys(api_key: str | None, api_key_file: Path | None, host: str) -> list[str] | None:
    """serve's API keys, with a warning where they show in ps or where none guards a
    public address."""
    import sys

    from disagg.frontends.keys import api_keys

    on_command_line = any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv)
    if api_key is not None and on_command_line:
        err.print(
            "[yellow]warning:[/] --api-key on the command line shows in ps to every "
            "user of this machine: use --api-key-file (chmod 600) or DISAGG_API_KEY",
            soft_wrap=True,
        )
    keys = api_keys(api_key, api_key_file) or None
    if keys is None and host not in LOOPBACK:
        err.print(
            f"[yellow]warning:[/] serving on {host} without an API key: anyone who reaches "
            "this port can use the models (add --api-key-file or DISAGG_API_KEY)",
            soft_wrap=True,
        )
    return keys


def _log_to_stderr(*names: str) -> None:
    """These loggers' lines on stderr, timestamped (serve's request and agent lines)."""
    import logging
    import sys

    from disagg_agents.wire.text import printable

    class Printable(logging.Formatter):  # a caller's ESC bytes never reach the terminal
        def format(self, record: logging.LogRecord) -> str:
            return printable(super().format(record), None)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Printable("%(asctime)s %(message)s", "%H:%M:%S"))
    for name in names:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


DTYPES = ("auto", "float32", "float16", "bfloat16")


def _check_think(local: bool, models: list[str | None], think: bool | str | None) -> None:
    """--think on a local model that does not reason apart: refused before any agent
    starts (a fleet's agents refuse it themselves, at once)."""
    if not local or think in (None, False):
        return
    from disagg.serving.defaultmodel import resolve_model
    from disagg.serving.preflight import reasons_apart

    for m in models:
        path = resolve_model(m, say)
        if reasons_apart(path) is False:
            raise UsageError(
                f"--think {think if isinstance(think, str) else 'on'}: {path.name} does not "
                "reason apart (its chat template has no <think> or harmony channels); "
                "leave --think out or set it to off"
            )


def _open_client(
    local: bool,
    models: list[str | None],
    inventory: str | None,
    dtype: str = "auto",
    n_decode: int = 1,
    prefill_model: str | None = None,
    allow_mixed: bool = False,
    prefix_disk: str | None = None,
    prefix_disk_mb: float | None = None,
    speculate: bool = True,
) -> Any:
    from disagg.api import Client
    from disagg.serving.localdisk import local_disk

    if dtype not in DTYPES:  # the agents' own argparse would say it after they start
        raise UsageError(f"--dtype {dtype}: use {', '.join(DTYPES)}")
    if (prefill_model or allow_mixed) and not local:
        raise UsageError(
            "--prefill-model and --allow-mixed go with --local; "
            "for a fleet, set mixed_weights = true on the pipeline in the inventory"
        )
    if (prefix_disk is not None or prefix_disk_mb is not None) and not local:
        raise UsageError(
            "--prefix-disk and --prefix-disk-mb go with --local; for a fleet, set "
            "prefix_disk and prefix_disk_mb on the pipeline in the inventory"
        )
    if not speculate and not local:
        raise UsageError(
            "--no-speculate goes with --local; a fleet's requests can each send speculate: false"
        )
    if not local:
        from disagg.fleet.inventory import InventoryError

        try:
            return Client(inventory)
        except InventoryError as e:
            if inventory is None and "not found" in str(e):
                raise InventoryError(f"{e}; or add --local to run the agents here") from None
            raise
    with err.status("starting prefill and decode agents…"):
        return Client.local(
            models,
            dtype=dtype,
            n_decode=n_decode,
            say=say,
            prefill_model=prefill_model,
            allow_mixed=allow_mixed,
            prefix_disk=local_disk(prefix_disk, prefix_disk_mb, say),
            speculate=speculate,
        )


@app.command()
@friendly
def generate(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt (chat template applied unless --raw).")
    ] = None,
    local: Local = False,
    model: Models = None,
    inventory: Inventory = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System message.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template.")] = False,
    kv_quant: Annotated[
        str | None,
        typer.Option(
            "--kv-quant",
            help="int8: lossy 8-bit KV on the wire (about 4x fewer bytes; text may differ "
            "from a lossless run: docs/performance.md, Lossy int8 K/V). Off by default.",
        ),
    ] = None,
    batch: Annotated[
        Path | None, typer.Option("--batch", help="JSONL file of requests to run concurrently.")
    ] = None,
    out_file: Annotated[
        Path | None, typer.Option("--out", help="Where --batch writes its JSONL results.")
    ] = None,
    prefill_model: PrefillModel = None,
    allow_mixed: AllowMixed = False,
    think: Annotated[
        str | None,
        typer.Option(
            "--think",
            help="reasoning models: on, off, or an effort (low, medium, high) where the "
            "model's chat template takes one",
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="structured output: json (any JSON object), or a JSON Schema file the "
            "answer must follow",
        ),
    ] = None,
    hide_reasoning: Annotated[
        bool, typer.Option("--hide-reasoning", help="Do not show the model's reasoning.")
    ] = False,
    placement: Annotated[
        str,
        typer.Option(
            "--placement",
            help="where the prompt is prefilled: auto (the decode agent's estimate), "
            "remote (the prefill agent) or local (the decode agent)",
        ),
    ] = "auto",
    dtype: Dtype = "auto",
    as_json: Json = False,
    prefix_disk: PrefixDisk = None,
    prefix_disk_mb: PrefixDiskMb = None,
) -> None:
    """Generate text: prefill agent -> KV over TCP -> decode agent."""
    from disagg.frontends.batch import BatchItem, load_requests
    from disagg.serving.checkedrequest import build_request

    sampling: dict[str, Any] = dict(max_tokens=max_tokens, temperature=temperature, seed=seed)
    sampling.update(top_p=top_p, system=system, raw=raw)
    opts = _request_opts(sampling, kv_quant, think, fmt, placement)
    # The request is built and checked before any agent starts.
    items: list[BatchItem] = []
    if batch is not None:
        items = load_requests(batch, opts)
    elif prompt is None:
        raise UsageError('give a prompt, e.g. disagg generate --local "Hi", or --batch FILE')
    request = build_request(prompt=prompt, **opts) if prompt is not None else None
    models: list[str | None] = list(model) if model else [None]
    _check_think(local, models, opts.get("think"))
    with _open_client(
        local,
        models,
        inventory,
        dtype,
        prefill_model=prefill_model,
        allow_mixed=allow_mixed,
        prefix_disk=prefix_disk,
        prefix_disk_mb=prefix_disk_mb,
    ) as client:
        # Local pipelines are named by their model dir; fleet ones by the inventory.
        names = (
            list(client.model_dirs) if local else [client.router.pipeline(m).name for m in models]
        )
        if request is not None and batch is None and len(names) == 1:
            _run_one(client, names[0], request, as_json, hide_reasoning)
            return
        if request is not None and not items:
            items = [BatchItem(i + 1, n, request) for i, n in enumerate(names)]
        _run_many(client, items, names[0], batch, out_file, as_json)


def _request_opts(
    opts: dict[str, Any],
    kv_quant: str | None,
    think: str | None,
    fmt: str | None,
    placement: str,
) -> dict[str, Any]:
    """generate's request fields from its flags, each refused naming the flag."""
    if placement not in ("auto", "remote", "local"):
        raise UsageError(f"--placement {placement!r}: use auto, remote or local")
    opts["placement"] = placement
    if kv_quant not in (None, "none", "int8"):
        raise UsageError(f"--kv-quant {kv_quant!r}: use int8, or leave it out")
    if kv_quant == "int8":
        opts["kv_quant"] = "int8"
    if think is not None:
        opts["think"] = _think(think)
    if fmt is not None:
        opts["response_format"] = _response_format(fmt)
    return opts


def _think(value: str) -> bool | str:
    on = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}
    if value.lower() in on:
        return on[value.lower()]
    if value in ("low", "medium", "high"):
        return value
    raise UsageError(f"--think {value!r}: use on, off, low, medium or high")


_FORMAT_KINDS = ("text", "json_object", "json_schema", "lark", "grammar")


def _response_format(value: str) -> dict[str, Any] | None:
    """--format: "json", or a JSON Schema file, through the request's one normalizer."""
    from disagg_agents.wire.request import JSON_TYPES, GenerateRequest, RequestError

    raw: Any = value
    if value != "json":
        try:
            raw = json.loads(Path(value).read_text())
        except OSError as e:
            why = f"use json, or a JSON Schema file ({e.strerror})"
            raise UsageError(f"--format {value}: {why}") from None
        except json.JSONDecodeError as e:
            why = f"not valid JSON ({e.msg} at line {e.lineno})"
            raise UsageError(f"--format {value}: {why}") from None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if isinstance(kind, str) and kind not in JSON_TYPES and kind not in _FORMAT_KINDS:
        # A file here is a JSON Schema: name its type as that, not as the wire's field.
        why = f"type {kind!r} is not a JSON Schema type (use one of {', '.join(JSON_TYPES)})"
        raise UsageError(f"--format {value}: {why}")
    try:
        rf = GenerateRequest.normalize_format(raw)
    except RequestError as e:
        raise UsageError(f"--format {value}: {e}", param=e.field) from None
    from disagg.serving.preflight import schema_error

    problem = schema_error(rf) if rf is not None and rf["type"] == "json_schema" else None
    if problem:
        raise UsageError(f"--format {value}: {problem}")
    return rf


def _run_one(client: Any, name: str, request: Any, as_json: bool, hide_reasoning: bool) -> None:
    from disagg.cli.render import metrics_table, tool_calls_table

    if as_json:
        c = client.generate(request, model=name)
    else:
        thinking = False
        for chunk in client.generate(request, model=name, stream=True):
            if chunk.reasoning and not hide_reasoning:
                # Reasoning goes to stderr, dim: stdout carries only the answer.
                err.print(chunk.reasoning, end="", style="dim", markup=False, highlight=False)
                thinking = True
            if chunk.text:
                if thinking:
                    err.print()
                    thinking = False
                out.print(chunk.text, end="", markup=False, highlight=False)
            c = chunk.completion
    model_dir = str(client.model_dirs.get(name, name))
    if as_json:
        print(
            json.dumps(
                {
                    "text": c.text,
                    "reasoning": c.reasoning,
                    "tool_calls": c.tool_calls,
                    "finish_reason": c.finish_reason,
                    "token_ids": c.token_ids,
                    "model": model_dir,
                    "metrics": c.metrics.to_json(),
                }
            )
        )
        return
    out.print()
    if c.tool_calls:
        out.print(tool_calls_table(c.tool_calls))
    # stderr: `> answer.txt` keeps the answer alone
    err.print(metrics_table(c.metrics, title=f"metrics: {name}"))


def _run_many(
    client: Any,
    items: list[Any],
    default: str,
    batch: Path | None,
    out_file: Path | None,
    as_json: bool,
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from disagg.cli.render import batch_table
    from disagg.frontends.batch import run_batch

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("requests", total=len(items))
        result = run_batch(client, items, default, on_done=lambda _r: progress.advance(task))
    summary: dict[str, Any] = {
        "requests": len(result.results),
        "failed": result.failed,
        "wall_time": result.wall_time,
        "sum_time": result.sum_time,
    }
    if batch is not None:
        target = out_file or batch.with_suffix(".results.jsonl")
        target.write_text("".join(json.dumps(r) + "\n" for r in result.results))
        summary["out"] = str(target)
    if as_json:
        print(json.dumps({**summary, "results": result.results}))
    else:
        out.print(batch_table(result.results, summary))
    if result.failed:
        raise typer.Exit(1)


# serve's options about callers and limits (docs/threat-model.md lists them).
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="DISAGG_API_KEY",
        help="Require this key (Authorization: Bearer KEY); shows in ps: prefer the env var.",
    ),
]
ApiKeyFile = Annotated[
    Path | None,
    typer.Option(
        "--api-key-file",
        help="Read the API keys from this file (0600; one per line, each a tenant; the first "
        "is the operator's: it sees the whole fleet in /ui).",
    ),
]
HeaderTimeout = Annotated[
    float, typer.Option("--header-timeout", help="Seconds a connection has to send its headers.")
]
FirstByteTimeout = Annotated[
    float,
    typer.Option(
        "--first-byte-timeout", help="Seconds a new connection has to send its first byte."
    ),
]
MaxConnections = Annotated[
    int | None,
    typer.Option(
        "--max-connections",
        help="Connections at once, in total (default: the open-files limit less 64).",
    ),
]
MaxPerAddress = Annotated[
    int,
    typer.Option("--max-per-address", help="Connections at once from one IPv4 /24 or IPv6 /64."),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        "--workers", help="Requests run at once (default: the decode agents' max_batch, summed)."
    ),
]
MaxRequests = Annotated[
    int | None,
    typer.Option(
        "--max-requests",
        help="Requests admitted at once, running or waiting for a worker (default: "
        "2 x workers); more get 429 (OpenAI) / 503 (Ollama) with Retry-After.",
    ),
]
MaxRequestsPerKey = Annotated[
    int | None,
    typer.Option(
        "--max-requests-per-key",
        help="Of those, what one API key may hold (default, with two keys or more: half "
        "of the workers, i.e. of the batch rows).",
    ),
]
MaxPromptTokensPerKey = Annotated[
    int | None,
    typer.Option(
        "--max-prompt-tokens-per-key",
        help="Prompt tokens one API key may have waiting for their first token (default, "
        "with two keys or more: 16384; a key's first request runs however long).",
    ),
]
MaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-tokens",
        help="Answer length for requests that set no limit (default: until the model "
        "stops or its context is full, as OpenAI and Ollama do).",
    ),
]
Speculate = Annotated[
    bool,
    typer.Option(
        "--speculate/--no-speculate",
        help="With --local: decode agents draft tokens from the prompt (prompt lookup) "
        "and check them in the batch's forward; the text is the same either way.",
    ),
]
DrainTimeout = Annotated[
    float,
    typer.Option(
        "--drain-timeout",
        help="Seconds a first Ctrl-C (or SIGTERM) lets running requests finish; "
        "a second Ctrl-C stops at once.",
    ),
]


@app.command()
@friendly
def serve(
    local: Local = False,
    model: Models = None,
    inventory: Inventory = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8080,
    decode_agents: Annotated[
        int, typer.Option("--decode-agents", help="Decode agents per model with --local.")
    ] = 1,
    dtype: Dtype = "auto",
    api_key: ApiKey = None,
    api_key_file: ApiKeyFile = None,
    header_timeout: HeaderTimeout = 10.0,
    first_byte_timeout: FirstByteTimeout = 5.0,
    max_connections: MaxConnections = None,
    max_per_address: MaxPerAddress = 64,
    workers: WorkersOpt = None,
    max_requests: MaxRequests = None,
    max_requests_per_key: MaxRequestsPerKey = None,
    max_prompt_tokens_per_key: MaxPromptTokensPerKey = None,
    drain_timeout: DrainTimeout = 30.0,
    max_tokens: MaxTokensOpt = None,
    prefix_disk: PrefixDisk = None,
    prefix_disk_mb: PrefixDiskMb = None,
    speculate: Speculate = True,
) -> None:
    """The gateway: OpenAI, Responses, Anthropic and Ollama APIs on one port.

    OpenAI's (/v1/chat/completions, /v1/completions, /v1/embeddings), OpenAI's
    Responses (/v1/responses: Codex), Anthropic's Messages (/v1/messages: Claude
    Code) and Ollama's (/api/...); the web view at /ui."""
    import signal
    import sys

    from disagg.frontends import maxtokens
    from disagg.frontends.app import create_app
    from disagg.frontends.limits import Limits, raise_nofile
    from disagg.frontends.limits import serve as serve_app
    from disagg.frontends.shutdown import Drain
    from disagg.frontends.workers import Workers
    from disagg.serving.supervise import Supervisor

    raise_nofile()  # before the local agents start: they inherit it

    _at_least_one(
        ("--decode-agents", decode_agents),
        ("--max-tokens", max_tokens),
        ("--workers", workers),
        ("--max-requests", max_requests),
        ("--max-requests-per-key", max_requests_per_key),
        ("--max-prompt-tokens-per-key", max_prompt_tokens_per_key),
    )
    keys = _serve_keys(api_key, api_key_file, host) or []
    key = keys or None
    _check_port(host, port)  # before any agent loads
    # SIGTERM (systemd, docker, kill) unwinds like Ctrl-C, so the local agents stop too;
    # uvicorn hands the signal back to this handler once it has shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with _open_client(
        local,
        list(model) if model else [None],
        inventory,
        dtype,
        decode_agents,
        prefix_disk=prefix_disk,
        prefix_disk_mb=prefix_disk_mb,
        speculate=speculate,
    ) as client:
        _announce(client.models(), host, port, bool(key), max_tokens)
        maxtokens.set_default(max_tokens)
        limits = Limits(header_timeout, max_connections, max_per_address, first_byte_timeout)
        pool = Workers.for_router(
            client.router,
            workers,
            max_requests,
            max_requests_per_key,
            keys=len(keys),
            per_key_tokens=max_prompt_tokens_per_key,
        )
        share = f", {pool.per_key} per key" if pool.per_key < pool.limit else ""
        if pool.per_key_tokens is not None:
            share += f", {pool.per_key_tokens} prompt tokens waiting per key"
        err.print(f"{pool.size} workers, at most {pool.limit} requests at once{share}")
        _log_to_stderr("disagg.requests", "disagg.agents")
        supervisor = Supervisor(client) if local else None
        drain = Drain(
            lambda: pool.admitted,
            client.stop_now,
            client.router.cut_all,
            drain_timeout,
            began=supervisor.draining if supervisor else lambda: "",
        )
        with supervisor or contextlib.nullcontext():
            serve_app(create_app(client, api_key=key, workers=pool), host, port, limits, drain)


def _announce(models: list[str], host: str, port: int, keyed: bool, max_tokens: int | None) -> None:
    """What `serve` serves, where, and how long an answer without a limit runs."""
    err.print(
        f"serving {', '.join(models)} on http://{host}:{port} "
        f"(OpenAI: /v1, Responses: /v1/responses, Anthropic: /v1/messages, "
        f"Ollama: /api){', API key required' if keyed else ''}",
        soft_wrap=True,
    )
    err.print(f"web view: http://{host}:{port}/ui{'?key=KEY' if keyed else ''}")
    cap = (
        f"at most {max_tokens} tokens"
        if max_tokens
        else "until the model stops or the context is full"
    )
    err.print(f"answers without a client limit run {cap} (--max-tokens)", soft_wrap=True)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_port(host: str, port: int) -> None:
    """Bind what uvicorn will bind, and let go: a busy port is refused in a second,
    not after the agents have loaded."""
    import errno
    import socket

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UsageError(
                        f"port {port} on {host} is in use (another disagg serve?): "
                        "choose another with --port"
                    ) from None
                if e.errno == errno.EACCES:
                    raise UsageError(
                        f"port {port} needs privileges here: choose one from 1024 with --port"
                    ) from None
                raise UsageError(
                    f"cannot listen on {host}:{port} ({e.strerror}): see --host"
                ) from None


def _at_least_one(*flags: tuple[str, int | None]) -> None:
    for flag, value in flags:
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")


@app.command()
@friendly
def verify(
    prompt: Annotated[str, typer.Argument()] = "What is the capital of France?",
    local: Local = False,
    model: Model = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 64,
    min_agreement: Annotated[
        float, typer.Option("--min-agreement", help="Fail below this token agreement (0..1).")
    ] = 1.0,
    raw: Annotated[bool, typer.Option("--raw")] = False,
    prefill_model: PrefillModel = None,
    allow_mixed: AllowMixed = False,
    dtype: Dtype = "auto",
    as_json: Json = False,
) -> None:
    """Greedy run twice: disaggregated and decode-only; report what the handoff changes."""
    from disagg.cli.render import verify_table
    from disagg.serving import wireclient
    from disagg.serving.checkedrequest import build_request
    from disagg.serving.pair import run_remote
    from disagg.serving.verify import compare

    need_local(local)
    if not 0 <= min_agreement <= 1:
        raise UsageError(f"--min-agreement must be in [0, 1], got {min_agreement}")
    request = build_request(
        prompt=prompt, max_tokens=max_tokens, raw=raw, logprobs=True, placement="remote"
    )
    with _open_client(
        True,
        [model],
        None,
        dtype,
        prefill_model=prefill_model,
        allow_mixed=allow_mixed,
        prefix_disk_mb=0,  # the handoff of every prompt token is what is checked
    ) as session:
        p, d = session.agents[0], session.agents[1]
        disagg = run_remote(p, d, request, require=False)
        # Decode-only: no prefill target, so the decode agent prefills itself.
        alone = wireclient.generate(d.host, d.port, request, token=d.token)
        model_dir = str(next(iter(session.model_dirs.values())))
    report = compare(disagg, alone, min_agreement, model_dir)
    if disagg.metrics.method != "disaggregated":
        why = f"the disaggregated run fell back: {disagg.metrics.fallback_reason}"
        report = dataclasses.replace(report, ok=False, error=why)
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        out.print(verify_table(report))
        if report.error:
            # As friendly() prints errors: the reason quotes an agent, never markup.
            err.print(Text.assemble(("error: ", "red"), report.error), highlight=False)
    if not report.ok:
        raise typer.Exit(1)

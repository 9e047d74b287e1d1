"""`disagg bench <kind>`: one command per benchmark, over one harness (`_run`): check
the settings, resolve the model, run the kind (`disagg.bench.sections`), print its
tables or its report as JSON. The bench package is imported only inside a command,
so no other command (`disagg serve` above all) loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from disagg.cli.common import Json, Local, Model, app, friendly, need_local, out, say
from disagg.errors import UsageError

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Measure the handoff against its peers, one kind per command (each needs --local).",
)
app.add_typer(bench_app, name="bench")

Repeats = Annotated[int, typer.Option("--repeats", help="Runs per comparison.")]
DecodeTokens = Annotated[int, typer.Option("--decode-tokens")]
PromptTokens = Annotated[int, typer.Option("--prompt-tokens")]
Sizes = Annotated[
    str,
    typer.Option(
        "--sizes",
        "--load-sizes",
        help="A preset (quick, small, issue) and/or key=value, comma-separated: rubric, "
        "submission, concurrency (1/4/16), requests (per slot), min_requests, rate "
        "(arrivals/s per slot), tokens, mixed, short, long, seed, peer (on/off), timeout.",
    ),
]
Png = Annotated[Path | None, typer.Option("--png", help="Draw TTFT against prompt length.")]


def _run(kind: str, local: bool, model: str | None, as_json: bool, **settings: Any) -> None:
    """The harness: `disagg.bench.sections.<kind>` on the resolved model, shown."""
    from disagg.bench import sections
    from disagg.serving.defaultmodel import resolve_model

    need_local(local)
    model_dir = resolve_model(model, say)
    _show(getattr(sections, kind)(model_dir, say, **settings), as_json)


def _show(section: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(section.report))
        return
    for table in section.tables:
        out.print(table)


def _core_settings(repeats: int, decode_tokens: int, prompt_tokens: int) -> dict[str, int]:
    if repeats < 1 or decode_tokens < 2 or prompt_tokens < 16:
        raise UsageError("--repeats >= 1, --decode-tokens >= 2, --prompt-tokens >= 16")
    return {"repeats": repeats, "decode_tokens": decode_tokens, "prompt_tokens": prompt_tokens}


def _check_sizes(sizes: str) -> None:
    """--sizes checked before anything runs: one line naming what is wrong."""
    from disagg.bench.sections import load_settings

    try:
        load_settings(sizes)
    except ValueError as e:
        raise UsageError(f"--sizes: {e}") from None


@bench_app.command()
@friendly
def core(
    local: Local = False,
    model: Model = None,
    repeats: Repeats = 3,
    decode_tokens: DecodeTokens = 64,
    prompt_tokens: PromptTokens = 2000,
    as_json: Json = False,
) -> None:
    """Decode tokens/s against mlx-lm's own generation, TTFT against transformers' prefill."""
    settings = _core_settings(repeats, decode_tokens, prompt_tokens)
    _run("core", local, model, as_json, **settings)


@bench_app.command()
@friendly
def wire(local: Local = False, model: Model = None, as_json: Json = False) -> None:
    """KV handoff GB/s vs a bare socket and JSON/base64 over HTTP; compression.

    Compression is weighed at 1 and 10 Gbit/s."""
    _run("wire", local, model, as_json)


@bench_app.command()
@friendly
def serving(
    local: Local = False, model: Model = None, png: Png = None, as_json: Json = False
) -> None:
    """TTFT/TPOT vs transformers and mlx-lm, decode memory, concurrency (slow).

    Prompts of 128, 1k and 4k tokens; --png draws TTFT against prompt length."""
    _run("serving", local, model, as_json, png=png)


@bench_app.command()
@friendly
def hiding(local: Local = False, model: Model = None, as_json: Json = False) -> None:
    """TTFT minus prefill compute behind a shaped link (needs root).

    The prefill agent sits in a network namespace behind a link shaped by tc to 1
    and 10 Gbit/s."""
    _run("hiding", local, model, as_json)


@bench_app.command()
@friendly
def kvquant(local: Local = False, model: Model = None, as_json: Json = False) -> None:
    """Lossy int8 KV vs lossless: bytes, logit error, token agreement."""
    _run("kvquant", local, model, as_json)


@bench_app.command("quant-weights")
@friendly
def quant_weights(local: Local = False, model: Model = None, as_json: Json = False) -> None:
    """A 4-bit checkpoint prefilled on packed weights vs dequantized at load.

    Memory, prefill tok/s and TTFT, and agreement with mlx-lm; on -m if it is
    quantized, else on the default model converted to 4 bits once."""
    _run("quant_weights", local, model, as_json)


@bench_app.command()
@friendly
def prefix(local: Local = False, model: Model = None, as_json: Json = False) -> None:
    """Prefix cache off vs on: TTFT, K/V bytes, same tokens.

    A ~3k-token shared prefix and 16 ~300-token suffixes."""
    _run("prefix", local, model, as_json)


@bench_app.command()
@friendly
def formats(local: Local = False, model: Model = None, as_json: Json = False) -> None:
    """Decode tok/s with a JSON Schema constraint vs without; schema compile time.

    At batch 1 and 16; the grader schema compiled cold and found cached."""
    _run("formats", local, model, as_json)


@bench_app.command()
@friendly
def speculate(
    local: Local = False,
    model: Model = None,
    decode_tokens: DecodeTokens = 96,
    as_json: Json = False,
) -> None:
    """Prompt-lookup drafts vs none: TPOT and tokens per forward, same tokens.

    A code edit (a ~300-line file returned whole) and free text, at batch 1 and 8,
    against mlx-lm's own generation at batch 1; in this process, greedy."""
    if decode_tokens < 2:
        raise UsageError("--decode-tokens >= 2")
    _run("speculate", local, model, as_json, decode_tokens=decode_tokens)


@bench_app.command()
@friendly
def load(
    local: Local = False,
    model: Model = None,
    sizes: Sizes = "small",
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help="Bench the disagg gateway running there (a fleet's `disagg serve`) "
            "instead of starting `disagg serve --local`; -m names its model's dir.",
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """The grader's load against mlx_lm.server: TTFT/TPOT p50/p99, gaps, tokens/s.

    A shared rubric, different submissions, Poisson arrivals at 1/4/16 concurrent,
    a mixed run; the longest inter-token gap."""
    _check_sizes(sizes)
    if url is not None and not url.startswith(("http://", "https://")):
        raise UsageError(f"--url takes http://HOST:PORT, not {url!r}")
    _run("load", local or url is not None, model, as_json, sizes=sizes, url=url)


@bench_app.command()
@friendly
def stall(
    local: Local = False, model: Model = None, prompt_tokens: PromptTokens = 1500,
    as_json: Json = False,
) -> None:  # fmt: skip
    """A stream's stall while its agent prefills another prompt; batch gain.

    The longest inter-token gap against the prefill's time, and 16 streams'
    decode rate against one's."""
    if prompt_tokens < 16:
        raise UsageError("--prompt-tokens >= 16")
    _run("stall", local, model, as_json, prompt_tokens=prompt_tokens)


@bench_app.command()
@friendly
def integrity(
    layer_mb: Annotated[float, typer.Option("--layer-mb", help="MiB per K/V frame.")] = 8.0,
    layers: Annotated[int, typer.Option("--layers", help="Frames per transfer.")] = 48,
    as_json: Json = False,
) -> None:
    """What sealing the frames (integrity "mac") costs a K/V handoff.

    On loopback: no model, no agents."""
    from disagg.bench import sections

    if layer_mb <= 0 or layers < 1:
        raise UsageError("--layer-mb > 0, --layers >= 1")
    _show(sections.integrity(say, layer_mb, layers), as_json)


@bench_app.command("all")
@friendly
def everything(
    local: Local = False,
    model: Model = None,
    repeats: Repeats = 3,
    decode_tokens: DecodeTokens = 64,
    prompt_tokens: PromptTokens = 2000,
    sizes: Sizes = "small",
    png: Png = None,
    as_json: Json = False,
) -> None:
    """Every kind in one report.

    core, then wire, serving, hiding, kvquant, quant-weights, prefix, formats and
    load."""
    settings = _core_settings(repeats, decode_tokens, prompt_tokens)
    _check_sizes(sizes)
    _run("run_all", local, model, as_json, core_settings=settings, sizes=sizes, png=png)

"""The `disagg` command: parses, calls, renders. Work happens elsewhere."""

from __future__ import annotations

import functools
import json
import traceback
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console

from .errors import DisaggError, UsageError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Disaggregated LLM inference: torch prefill, MLX decode, KV over raw TCP.",
)
out = Console()
err = Console(stderr=True)
STATE = {"debug": False}


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False) -> None:
    STATE["debug"] = debug


def friendly(fn: Callable[..., None]) -> Callable[..., None]:
    """Turn a DisaggError into one red line and exit 1; tracebacks only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except DisaggError as e:
            if STATE["debug"]:
                traceback.print_exc()
            err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def _say(msg: str) -> None:
    err.print(f"[dim]{msg}[/]")


Model = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Local HF model dir (default: embedded SmolLM2)."),
]
Local = Annotated[bool, typer.Option("--local", help="Run both agents on this machine.")]
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout, nothing else.")
]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, float16 or bfloat16.")]


def _need_local(local: bool) -> None:
    if not local:
        raise UsageError(
            "only --local runs are available in this version: add --local to run both agents here"
        )


@app.command()
@friendly
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt (chat template applied unless --raw).")],
    local: Local = False,
    model: Model = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System message.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template.")] = False,
    dtype: Dtype = "auto",
    as_json: Json = False,
) -> None:
    """Generate text: prefill agent -> KV over TCP -> decode agent."""
    from . import client
    from .local import build_request, resolve_model
    from .render import metrics_table

    _need_local(local)
    build_request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    model_dir = resolve_model(model, _say)
    with _Started(model_dir, dtype) as (p, d):
        req = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            system=system,
            raw=raw,
            prefill=p,
        )
        on_text = (
            None if as_json else (lambda s: out.print(s, end="", markup=False, highlight=False))
        )
        result = client.generate(d.host, d.port, req, on_text=on_text)
    if as_json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "model": str(model_dir),
                    "metrics": result.metrics,
                }
            )
        )
        return
    out.print()
    out.print(metrics_table(result.metrics))


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
    dtype: Dtype = "auto",
    as_json: Json = False,
) -> None:
    """Greedy run twice: disaggregated and decode-only; report what the handoff changes."""
    from . import client
    from .local import build_request, resolve_model
    from .render import verify_table
    from .verify import compare

    _need_local(local)
    if not 0 <= min_agreement <= 1:
        raise UsageError(f"--min-agreement must be in [0, 1], got {min_agreement}")
    build_request(prompt, max_tokens=max_tokens)
    model_dir = resolve_model(model, _say)
    with _Started(model_dir, dtype) as (p, d):
        base: dict[str, Any] = {"max_tokens": max_tokens, "raw": raw, "logprobs": True}
        disagg = client.generate(d.host, d.port, build_request(prompt, prefill=p, **base))
        alone = client.generate(d.host, d.port, build_request(prompt, **base))
    report = compare(disagg, alone, min_agreement, str(model_dir))
    if disagg.metrics.get("method") != "disaggregated":
        report["ok"] = False
        report["error"] = (
            f"the disaggregated run fell back: {disagg.metrics.get('fallback_reason')}"
        )
    if as_json:
        print(json.dumps(report))
    else:
        out.print(verify_table(report))
        if report.get("error"):
            err.print(f"[red]error:[/] {report['error']}")
    if not report["ok"]:
        raise typer.Exit(1)


class _Started:
    """Start local agents with a spinner on stderr; stop them on exit."""

    def __init__(self, model_dir: Any, dtype: str) -> None:
        self.model_dir, self.dtype = model_dir, dtype

    def __enter__(self) -> Any:
        from .launcher import start_local_pair

        with err.status("starting prefill and decode agents…"):
            self.pair = start_local_pair(self.model_dir, dtype=self.dtype)
        return self.pair

    def __exit__(self, *exc: Any) -> None:
        for agent in reversed(self.pair):
            agent.stop()


def main() -> None:
    app()


if __name__ == "__main__":
    main()

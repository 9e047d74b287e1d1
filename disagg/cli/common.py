"""What every `disagg` command shares: the typer app, the consoles, the error
wrapper and the option types. Command modules add their commands to `app`."""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from disagg.errors import DisaggError, UsageError


def _flags_without_a_type() -> None:
    """typer's help shows `<bool>` beside every on/off flag, which takes no value:
    show nothing there, as click does."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "disagg_patched", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.disagg_patched = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_a_type()
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Disaggregated LLM inference: torch prefill, MLX decode, KV over raw TCP.",
)
out = Console()
err = Console(stderr=True)
STATE = {"debug": False}
# The options' names for request fields, so an error names what the user typed.
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p"}


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
            flag = FLAGS.get(e.param or "") if isinstance(e, UsageError) else None
            line = f"{e} ({flag})" if flag else str(e)
            # A Text, not markup: messages quote user input that may hold [brackets],
            # and agents' ERROR text (escapes removed, control characters shown).
            err.print(
                Text.assemble(("error: ", "red"), safe_lines(line)), highlight=False, soft_wrap=True
            )
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/]")
            raise typer.Exit(130) from None

    wrapper.__doc__ = help_paragraphs(fn.__doc__ or "")
    return wrapper


def help_paragraphs(doc: str) -> str:
    """A docstring as `--help` should wrap it: each paragraph one line (typer keeps a
    docstring's line breaks after the first paragraph, so help broke mid-sentence)."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split("\n")) for p in paragraphs)


def say(msg: str) -> None:
    err.print(Text(safe_lines(msg), style="dim"), highlight=False)


def safe_lines(text: str) -> str:
    """disagg.cli.plain's path, lines kept."""
    from disagg.cli.plain import plain_lines

    return plain_lines(text, None).plain


Model = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Local HF model dir (default: embedded SmolLM2)."),
]
Models = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        "-m",
        help="Model: a local dir with --local, else a pipeline's "
        "model name; repeat to run several at once.",
    ),
]
Inventory = Annotated[
    str | None,
    typer.Option(
        "--inventory",
        "-i",
        envvar="DISAGG_INVENTORY",
        help="Inventory file (default: ./inventory.toml).",
    ),
]
Local = Annotated[bool, typer.Option("--local", help="Run the agents on this machine.")]
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout, nothing else.")
]
PrefillModel = Annotated[
    str | None,
    typer.Option(
        "--prefill-model",
        help="With --local: the prefill agent loads this dir instead of --model "
        "(e.g. bf16 prefill, 4-bit decode); needs --allow-mixed.",
    ),
]
AllowMixed = Annotated[
    bool,
    typer.Option(
        "--allow-mixed",
        help="With --local: let prefill and decode run on different weights; "
        'results then say weights: "mixed".',
    ),
]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, float16 or bfloat16.")]
PrefixDisk = Annotated[
    str | None,
    typer.Option(
        "--prefix-disk",
        metavar="DIR",
        help="With --local: where decode agents keep prompt K/V across restarts "
        "(default: prefix-disk in the cache dir, ~/.cache/disagg).",
    ),
]
PrefixDiskMb = Annotated[
    float | None,
    typer.Option(
        "--prefix-disk-mb",
        help="With --local: most disk each decode agent's prefix tier takes "
        "(default 4096 MB, or a tenth of the free space if less; 0: off).",
    ),
]


def need_local(local: bool) -> None:
    if not local:
        raise UsageError(
            "only --local runs are available for this command: add --local to run the agents here"
        )

"""The `kvdeck` command line.

Each command is a thin shell over `runtime/`: it parses options, calls the runtime, and
prints. Errors a user can cause arrive as `KvdeckError` and are printed as one sentence with
exit code 2, never as a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from runtime.errors import KvdeckError

app = typer.Typer(
    name="kvdeck",
    help="A terminal operator console hosting a local LLM inference runtime.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def fail(message: str) -> None:
    """Print a user error as one line on stderr and exit with code 2."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except KvdeckError as e:
        fail(str(e))


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.callback()
def root() -> None:
    """kvdeck: watch and tune a local LLM inference runtime, replay its runs, serve its API."""


@app.command()
def models(
    target: str = typer.Argument(
        None, metavar="[PATH|NAME]", help="A model name from the list, or a path to a .gguf file."
    ),
    default: bool = typer.Option(False, "--default", help="Report on the embedded default model."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    block_size: int = typer.Option(
        16, "--block-size", help="KV block size in tokens (1-256), for block counts."
    ),
) -> None:
    """List runnable models, or report one model's architecture and KV cost."""
    from console.model_report import render_model_list, render_model_report
    from runtime.config import check_int
    from runtime.models.info import model_report, read_model_info
    from runtime.models.registry import DEFAULT_MODEL, list_models, resolve_model

    guarded(lambda: check_int("--block-size", block_size, 1, 256))
    if default:
        target = DEFAULT_MODEL
    if target is None:
        entries = guarded(list_models)
        if as_json:
            print_json([
                {"name": e.name, "source": e.source, "description": e.description,
                 "path": str(e.path) if e.path else None, "available": e.available,
                 "note": e.note}
                for e in entries
            ])
        else:
            render_model_list(out, entries)
        return
    info = guarded(lambda: read_model_info(resolve_model(target)))
    report = model_report(info, block_size)
    if as_json:
        print_json(report)
    else:
        render_model_report(out, report)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

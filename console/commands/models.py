"""`kvdeck models` (the models kvdeck can run, and one model's facts) and `kvdeck probe`
(what the llama.cpp probe found on this machine)."""

from __future__ import annotations

import typer

from kvdeck.console.commands.common import guarded, out, print_json
from kvdeck.console.options import with_log_level
from kvdeck.runtime.core.config import check_int
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.logs import setup_logging


@with_log_level
def models(
    target: str = typer.Argument(
        None, metavar="[PATH|NAME]", help="A model name from the list, or a path to a .gguf file."
    ),
    default: bool = typer.Option(False, "--default", help="Report on the embedded default model."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    block_size: int = typer.Option(
        16, "--block-size", help="KV block size in tokens (1-256), for block counts."
    ),
    log_level: str = "warning",
) -> None:
    """List runnable models, or report one model's architecture and KV cost."""
    from kvdeck.console.model_report import render_model_list, render_model_report
    from kvdeck.runtime.models.info import model_report, read_model_info
    from kvdeck.runtime.models.registry import DEFAULT_MODEL, list_models, resolve_model

    guarded(lambda: setup_logging(log_level))
    guarded(lambda: check_int("--block-size", block_size, 1, 256))
    if default:
        target = DEFAULT_MODEL
    if target is None:
        entries = guarded(list_models)
        if as_json:
            print_json([
                {"name": e.name, "source": e.source, "description": e.description,
                 "path": str(e.path) if e.path else None, "available": e.available,
                 "kind": e.kind, "note": e.note}
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


@with_log_level
def probe(
    refresh: bool = typer.Option(False, "--refresh", help="Probe again, ignoring the cached "
                                 "verdict."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    log_level: str = "warning",
) -> None:
    """Show whether llama.cpp's kernels work on this machine: its re-packed (extra buffer
    type) kernels and its plain ones, each tried in a child process once per llama-cpp-python
    build and CPU, and cached. `--llama-repack auto` follows this verdict."""
    from kvdeck.runtime.executors.llama_cpp_probe import CACHE_FILE, LOG_FILE, verdict
    from kvdeck.runtime.resources import cache_dir

    def go():
        setup_logging(log_level)
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise KvdeckError("llama-cpp-python is not installed: there is nothing to probe "
                              "(the console and serve run the torch executor).") from None
        return verdict(refresh=refresh)

    v = guarded(go)
    if as_json:
        print_json({"repack": v.repack, "amx": v.amx, "cached": v.cached, "key": v.key,
                    "note": v.note, "attempts": [a.__dict__ for a in v.attempts],
                    "cache": str(cache_dir() / CACHE_FILE)})
        return
    found = {True: "its re-packed kernels work: --llama-repack auto uses them",
             False: "only its plain kernels work: --llama-repack auto runs without re-packed "
                    "weights",
             None: "it crashes with and without re-packed weights: the console and serve "
                   "choose the torch executor"}[v.repack]
    out.print(f"llama.cpp on this machine: {found}"
              f"{' (cached verdict; --refresh probes again)' if v.cached else ''}.",
              highlight=False, soft_wrap=True)
    for a in v.attempts:
        out.print(f"  extra buffer types {'on ' if a.repack else 'off'}: {a.outcome} "
                  f"({a.seconds:.1f} s)", highlight=False)
    if v.note:
        out.print(f"  {v.note}", highlight=False, soft_wrap=True)
    out.print(f"  cache {cache_dir() / CACHE_FILE}, child output {cache_dir() / LOG_FILE}",
              highlight=False, soft_wrap=True)

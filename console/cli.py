"""The `kvdeck` command line: the typer app and its commands, registered in `--help`'s order.

Each command lives in `console/commands/` (one module per command or family) and is a thin
shell over `runtime/`: it parses options, asks `kvdeck.runtime.session` for an engine built
from the layered settings (executor defaults, `--config`, flags), runs it, and prints or
opens a screen. Errors a user can cause arrive as `KvdeckError` and are printed as one
sentence with exit code 2, never as a traceback (`commands/common.py`).
"""

from __future__ import annotations

import os
import sys

import typer

from kvdeck.console import supervisor
from kvdeck.console.commands import (
    attach,
    bench,
    calibrate,
    live,
    models,
    plan,
    quality,
    runs,
    scenario,
    serve,
)

app = typer.Typer(
    name="kvdeck",
    help="A terminal operator console hosting a local LLM inference runtime.",
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.callback(invoke_without_command=True)(live.root)
app.command()(live.console)
app.command()(models.models)
app.command()(models.probe)
app.command("run-trace")(runs.run_trace)
app.command()(quality.quality)
app.command()(calibrate.calibrate)
app.command()(plan.plan)
app.command()(plan.sweep)
app.add_typer(scenario.app, name="scenario")
app.command(help=serve.HELP)(serve.serve)
app.command()(bench.bench)
app.command()(attach.attach)
app.command()(runs.replay)
app.command()(runs.compare)


def main() -> None:
    """Console-script entry point: the console and the server run under a supervising
    parent (`console/supervisor.py`), every other command in this process."""
    argv = sys.argv[1:]
    commands = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    if supervisor.wants_supervisor(argv, commands):
        sys.exit(supervisor.supervise(argv))
    if os.environ.get(supervisor.SUPERVISED):
        supervisor.as_child()
    app()


if __name__ == "__main__":
    main()

"""The console: `kvdeck` without a command and `kvdeck console`."""

from __future__ import annotations

import typer

from kvdeck.console import supervisor
from kvdeck.console.commands.common import fail, guarded
from kvdeck.console.options import SettingsRequest, with_settings
from kvdeck.runtime.logs import setup_logging

RATE_HELP = ("Built-in traffic: arrivals per second (default 0.5 on a real model, 3 "
             "simulated).")


@with_settings
def root(
    ctx: typer.Context,
    rate: float = typer.Option(None, "--rate", help=RATE_HELP, rich_help_panel="Traffic"),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """kvdeck: watch and tune a local LLM inference runtime, replay its runs, serve its API.

    Without a command, opens the console on the embedded default model with traffic
    flowing; it takes every option `kvdeck console` takes (`kvdeck --executor torch`).
    """
    if ctx.invoked_subcommand is None:
        run_console(settings, rate, log_level)
    elif settings.flags or settings.config or rate is not None:
        fail(f"options before a command apply to the bare `kvdeck` (the console) only; put "
             f"them after `{ctx.invoked_subcommand}`.")


@with_settings
def console(
    rate: float = typer.Option(None, "--rate", help=RATE_HELP, rich_help_panel="Traffic"),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Open the operator console on a live engine with built-in traffic."""
    run_console(settings, rate, log_level)


def run_console(request: SettingsRequest, rate: float | None, log_level: str) -> None:
    """Build an engine with built-in traffic and run the console on it."""
    from kvdeck.console.app import KvdeckApp
    from kvdeck.runtime.runs.traffic import TrafficGenerator
    from kvdeck.runtime.session import build_session

    log_path = guarded(lambda: setup_logging(log_level, to_stderr=False))

    def build():
        session = build_session(request.resolve("auto"), live=True)
        return session, TrafficGenerator.for_engine(session.engine, rate)

    session, traffic = guarded(build)
    supervisor.record(executor=session.settings.executor, log=str(log_path))
    KvdeckApp(session.engine, traffic, settings=session.settings).run()

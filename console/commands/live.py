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
    replicas: int = typer.Option(1, "--replicas", help="Above 1: a simulated fleet of this "
                                 "many replicas behind --router, in the fleet screen (sim "
                                 "executor).", rich_help_panel="Fleet"),
    router: str = typer.Option("weighted", "--router", help="The fleet's router (as "
                               "run-trace's --router).", rich_help_panel="Fleet"),
    trace: str = typer.Option(None, "--trace", help="The fleet's arrivals (default: the "
                              "Mooncake sample, or Poisson at --rate when given).",
                              rich_help_panel="Fleet"),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Open the operator console on a live engine with built-in traffic; with --replicas N,
    on a simulated fleet in the fleet screen."""
    if replicas != 1 or trace is not None:
        run_fleet_console(settings, replicas, router, trace, rate, log_level)
        return
    run_console(settings, rate, log_level)


def run_fleet_console(request: SettingsRequest, replicas: int, router: str,
                      trace: str | None, rate: float | None, log_level: str) -> None:
    """A simulated fleet on one clock, paced to the wall clock, in the fleet screen."""
    from kvdeck.console.screens.fleet import FleetApp
    from kvdeck.runtime.cluster.live import LiveFleet
    from kvdeck.runtime.cluster.replicas import Cluster, ClusterConfig, replica_roles
    from kvdeck.runtime.errors import ConfigError
    from kvdeck.runtime.runs.trace import load_arrivals, synthetic_arrivals
    from kvdeck.runtime.session import build_session

    guarded(lambda: setup_logging(log_level, to_stderr=False))

    def build() -> LiveFleet:
        settings = request.resolve("sim")
        if settings.session.executor != "sim":
            raise ConfigError("--replicas runs a simulated fleet: it takes --executor sim.")
        roles = replica_roles(replicas, 0, 0)
        config = ClusterConfig(router=router)
        if trace is None and rate is not None:
            arrivals = synthetic_arrivals(100_000, rate)
        else:
            arrivals = load_arrivals(trace or "mooncake-conversation")
        sessions = [build_session(settings, with_tokenizer=False) for _ in roles]
        cluster = Cluster([s.engine for s in sessions], roles, config,
                          vocab_size=sessions[0].vocab_size)
        return LiveFleet(cluster, arrivals, settings.session.pace or 1.0, sessions)

    fleet = guarded(build)
    FleetApp(fleet, interval_s=0.5,
             title=f"kvdeck — simulated fleet, {fleet.cluster.router.describe()}").run()


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

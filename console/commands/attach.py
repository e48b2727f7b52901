"""`kvdeck attach`: the console over a remote engine's metrics."""

from __future__ import annotations

import typer

from kvdeck.console.commands.common import guarded
from kvdeck.console.options import with_log_level
from kvdeck.runtime.core.config import check_float
from kvdeck.runtime.logs import setup_logging


@with_log_level
def attach(url: str = typer.Argument(..., help="Base URL of a kvdeck, vLLM, SGLang or "
                                                "llama.cpp server, e.g. http://127.0.0.1:8000"),
           interval: float = typer.Option(1.0, "--interval", help="Seconds between scrapes."),
           log_level: str = "warning") -> None:
    """Watch a running server through its /metrics: queue, request rate, preemptions, KV
    usage, prefix hits, latency and throughput. When scrapes fail, the panels keep the last
    good figures, marked stale."""
    from kvdeck.console.screens.attach import AttachApp

    guarded(lambda: setup_logging(log_level, to_stderr=False))
    guarded(lambda: check_float("--interval", interval, 0.05, 3600.0))
    app = guarded(lambda: AttachApp(url, interval_s=interval))
    app.run()

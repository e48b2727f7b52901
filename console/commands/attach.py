"""`kvdeck attach`: the console over remote engines' metrics (and their KV events)."""

from __future__ import annotations

import typer

from kvdeck.console.commands.common import guarded
from kvdeck.console.options import with_log_level
from kvdeck.runtime.core.config import check_float
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.logs import setup_logging


@with_log_level
def attach(urls: list[str] = typer.Argument(
               None, help="Base URL of a kvdeck, vLLM, SGLang or llama.cpp server, e.g. "
               "http://127.0.0.1:8000; several: the fleet screen."),
           fleet: str = typer.Option(None, "--fleet", help="A TOML file of replicas (url, "
                                     "kv_events, kv_replay, kv_topic each): the fleet screen."),
           interval: float = typer.Option(1.0, "--interval", help="Seconds between scrapes."),
           kv_events: str = typer.Option(
               None, "--kv-events", help="One server's KV-events endpoint as it was told it "
               "(the `endpoint` of vLLM's or kvdeck's --kv-events-config, e.g. tcp://*:5557; "
               "a `*` means the server binds and kvdeck connects to the URL's host)."),
           kv_replay: str = typer.Option(
               None, "--kv-replay", help="Its `replay_endpoint`: lost messages and blocks "
               "stored before attaching are asked for there."),
           kv_topic: str = typer.Option("", "--kv-topic", help="Its events' `topic`."),
           tokenizer: str = typer.Option(
               None, "--tokenizer", help="A GGUF (or a model name kvdeck knows) whose "
               "tokenizer decodes cached spans to text (and encodes the router's prompt)."),
           log_level: str = "warning") -> None:
    """Watch running servers from outside (docs/attach.md). One URL: its /metrics — queue,
    request rate, preemptions, KV usage, prefix hits, latency, throughput — and with
    --kv-events its prefix cache as a tree. Several URLs or --fleet: every replica side by
    side, one prefix tree across them, and a longest-prefix router's scores. When scrapes
    fail, the figures kept are marked stale; a replica gone is marked down."""
    guarded(lambda: setup_logging(log_level, to_stderr=False))
    guarded(lambda: check_float("--interval", interval, 0.05, 3600.0))
    tok = guarded(lambda: _tokenizer(tokenizer)) if tokenizer else None
    urls = urls or []
    if fleet or len(urls) > 1:
        from kvdeck.console.screens.fleet import FleetApp
        from kvdeck.runtime.fleet.fleet import Fleet, ReplicaSpec, load_fleet

        def specs():
            if kv_events:
                raise ConfigError("--kv-events names one server's endpoint; for a fleet give "
                                  "each replica's kv_events in a --fleet file.")
            return (load_fleet(fleet) if fleet else []) + [ReplicaSpec.of_url(u) for u in urls]
        app = FleetApp(Fleet(guarded(specs), interval), interval, tok)
    elif urls:
        from kvdeck.console.screens.attach import AttachApp

        app = guarded(lambda: AttachApp(urls[0], interval_s=interval, kv_events=kv_events,
                                        kv_replay=kv_replay, kv_topic=kv_topic, tokenizer=tok))
    else:
        guarded(_no_server)
        return
    app.run()


def _no_server() -> None:
    raise ConfigError("Give a server URL (or several, or --fleet FILE) to attach to.")


def _tokenizer(name: str):
    from kvdeck.runtime.models.registry import resolve_model
    from kvdeck.runtime.text.tokenizer import Tokenizer

    return Tokenizer(resolve_model(name))

"""`kvdeck attach`: the console over a remote engine's metrics (and its KV events)."""

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
           kv_events: str = typer.Option(
               None, "--kv-events", help="The server's KV-events endpoint as it was told it "
               "(the `endpoint` of vLLM's or kvdeck's --kv-events-config, e.g. tcp://*:5557; "
               "a `*` means the server binds and kvdeck connects to the URL's host)."),
           kv_replay: str = typer.Option(
               None, "--kv-replay", help="Its `replay_endpoint`: lost messages and blocks "
               "stored before attaching are asked for there."),
           kv_topic: str = typer.Option("", "--kv-topic", help="Its events' `topic`."),
           tokenizer: str = typer.Option(
               None, "--tokenizer", help="A GGUF (or a model name kvdeck knows) whose "
               "tokenizer decodes the cached spans to text."),
           log_level: str = "warning") -> None:
    """Watch a running server through its /metrics: queue, request rate, preemptions, KV
    usage, prefix hits, latency and throughput; with --kv-events, its prefix cache as a tree
    (docs/attach.md). When scrapes fail, the panels keep the last good figures, marked
    stale."""
    from kvdeck.console.screens.attach import AttachApp

    guarded(lambda: setup_logging(log_level, to_stderr=False))
    guarded(lambda: check_float("--interval", interval, 0.05, 3600.0))
    tok = guarded(lambda: _tokenizer(tokenizer)) if tokenizer else None
    app = guarded(lambda: AttachApp(url, interval_s=interval, kv_events=kv_events,
                                    kv_replay=kv_replay, kv_topic=kv_topic, tokenizer=tok))
    app.run()


def _tokenizer(name: str):
    from kvdeck.runtime.models.registry import resolve_model
    from kvdeck.runtime.text.tokenizer import Tokenizer

    return Tokenizer(resolve_model(name))

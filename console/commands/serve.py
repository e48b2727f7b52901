"""`kvdeck serve`: the OpenAI-compatible API."""

from __future__ import annotations

import typer

from kvdeck.console import supervisor
from kvdeck.console.commands.common import guarded, out, settings_line
from kvdeck.console.options import SettingsRequest, with_settings
from kvdeck.runtime.core.config import check_float, check_int
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.logs import setup_logging

HELP = ("Serve a model through an OpenAI-compatible API (completions, chat, streaming).\n\n"
        "With --executor sim the API answers with a simulated card's timing, paced to the "
        "wall clock, for testing clients, load generators and dashboards without the card.")
"""`kvdeck serve --help`'s text (the docstring would be the summary line only)."""


@with_settings
def serve(
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Bind address; anything but loopback is an explicit choice."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port)."),
    api_key: str = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY'."),
    with_console: bool = typer.Option(False, "--console",
                                      help="Open the console on the serving engine."),
    request_timeout: float = typer.Option(
        600.0, "--request-timeout", help="Abort a request running longer than this many "
        "seconds (0: no bound).", rich_help_panel="Serving limits"),
    shutdown_timeout: float = typer.Option(
        5.0, "--shutdown-timeout", help="On SIGINT/SIGTERM, seconds running requests may "
        "finish before they are aborted.", rich_help_panel="Serving limits"),
    default_max_tokens: int = typer.Option(
        1024, "--default-max-tokens", help="Output bound of a chat request that sets none "
        "(completions default to 16, as OpenAI's).", rich_help_panel="Serving limits"),
    read_timeout: float = typer.Option(
        10.0, "--read-timeout", help="Seconds a client may take to send its request "
        "headers, and between chunks of its body (408 after).",
        rich_help_panel="Serving limits"),
    metrics_require_key: bool = typer.Option(
        False, "--metrics-require-key", help="/metrics needs the API key too (it is open by "
        "default, as Prometheus scrapers expect).", rich_help_panel="Serving limits"),
    kv_events_config: str = typer.Option(
        None, "--kv-events-config", help="Publish the prefix cache's changes as vLLM's KV "
        "events, with vLLM's JSON fields, e.g. '{\"enable_kv_cache_events\": true, "
        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
        "(docs/attach.md).", rich_help_panel="Serving limits"),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Serve a model through an OpenAI-compatible API."""
    from kvdeck.runtime.fleet.publisher import EventPublisher, KVEventsConfig
    from kvdeck.runtime.server.app import ServeLimits
    from kvdeck.runtime.server.serve import ApiServer
    from kvdeck.runtime.session import build_session

    def build():
        log_path = setup_logging(log_level, to_stderr=not with_console)
        check_int("--port", port, 0, 65535)
        check_int("--default-max-tokens", default_max_tokens, 1, 1 << 24)
        for name, value in (("--request-timeout", request_timeout),
                            ("--shutdown-timeout", shutdown_timeout),
                            ("--read-timeout", read_timeout)):
            check_float(name, value, 0.0, 1e6)
        if read_timeout <= 0:
            raise ConfigError(f"--read-timeout must be greater than 0, got {read_timeout}.")
        events = KVEventsConfig.parse(kv_events_config) if kv_events_config else None
        session = build_session(settings.resolve("auto"), live=True)
        supervisor.record(executor=session.settings.executor, log=str(log_path))
        if events is not None and events.publishes:
            try:
                publisher = EventPublisher(events, session.engine.kv.block_size).start()
            except ConfigError:
                session.close()
                raise
            publisher.attach(session.engine)
        return session

    session = guarded(build)
    limits = ServeLimits(read_timeout_s=read_timeout,
                         request_timeout_s=request_timeout or None,
                         default_max_tokens=default_max_tokens,
                         metrics_need_key=metrics_require_key)
    serving = {"host": host, "port": port, "api_key": api_key, "limits": limits,
               "shutdown_timeout_s": shutdown_timeout, "header_timeout_s": read_timeout}
    if with_console:
        from kvdeck.console.app import KvdeckApp

        # The console owns the engine loop; the HTTP server runs beside it in a thread.
        console_app = KvdeckApp(session.engine, settings=session.settings)
        server = ApiServer(session, loop=console_app.loop, **serving).start()
        console_app.before_shutdown.append(server.stop)
        console_app.run()
        return
    server = ApiServer(session, **serving)
    # soft_wrap: one logical line each, not cut at 80 columns in a log or a pipe.
    out.print(settings_line(session), highlight=False, soft_wrap=True)
    server.run(on_listening=lambda p: out.print(
        f"serving {session.model_id} on http://{host}:{p}/v1", highlight=False,
        soft_wrap=True))

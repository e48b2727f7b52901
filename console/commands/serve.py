"""`kvdeck serve`: the OpenAI-compatible API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

from kvdeck.console import supervisor
from kvdeck.console.commands.common import guarded, out, settings_line
from kvdeck.console.options import SettingsRequest, with_options, with_settings
from kvdeck.runtime.core.config import check_float, check_int
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.logs import setup_logging

HELP = ("Serve a model through an OpenAI-compatible API (completions, chat, streaming).\n\n"
        "With --executor sim the API answers with a simulated card's timing, paced to the "
        "wall clock, for testing clients, load generators and dashboards without the card.\n\n"
        "--model twice serves two models, each on its own engine, routed by the request's "
        "'model'; --cascade SMALL,LARGE adds a model 'cascade' that answers with SMALL and "
        "escalates to LARGE when SMALL is unsure (docs/serving.md).")
"""`kvdeck serve --help`'s text (the docstring would be the summary line only)."""


@dataclass(frozen=True)
class ServeOptions:
    """What `kvdeck serve` serves, where and within which limits."""

    host: Annotated[str, typer.Option(
        "--host", help="Bind address; anything but loopback is an explicit choice.")] = \
        "127.0.0.1"
    port: Annotated[int, typer.Option(
        "--port", help="TCP port (0: any free port).")] = 8000
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY'.")] = None
    with_console: Annotated[bool, typer.Option(
        "--console", help="Open the console on the serving engine (the first model's).")] \
        = False
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", help="Abort a request running longer than this many "
        "seconds (0: no bound).", rich_help_panel="Serving limits")] = 600.0
    shutdown_timeout: Annotated[float, typer.Option(
        "--shutdown-timeout", help="On SIGINT/SIGTERM, seconds running requests may "
        "finish before they are aborted.", rich_help_panel="Serving limits")] = 5.0
    default_max_tokens: Annotated[int, typer.Option(
        "--default-max-tokens", help="Output bound of a chat request that sets none "
        "(completions default to 16, as OpenAI's).", rich_help_panel="Serving limits")] = 1024
    read_timeout: Annotated[float, typer.Option(
        "--read-timeout", help="Seconds a client may take to send its request "
        "headers, and between chunks of its body (408 after).",
        rich_help_panel="Serving limits")] = 10.0
    metrics_require_key: Annotated[bool, typer.Option(
        "--metrics-require-key", help="/metrics needs the API key too (it is open by "
        "default, as Prometheus scrapers expect).", rich_help_panel="Serving limits")] = False
    kv_events_config: Annotated[str | None, typer.Option(
        "--kv-events-config", help="Publish the prefix cache's changes as vLLM's KV "
        "events, with vLLM's JSON fields, e.g. '{\"enable_kv_cache_events\": true, "
        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
        "(docs/attach.md).", rich_help_panel="Serving limits")] = None
    lora_modules: Annotated[list[str] | None, typer.Option(
        "--lora-modules", help="NAME=PATH: serve a LoRA adapter (a PEFT folder or a "
        "llama.cpp adapter GGUF) for the model, asked for as model NAME or BASE:NAME, or "
        "with 'lora': NAME; repeat for more (torch executor).",
        rich_help_panel="Many models")] = None
    cascade: Annotated[str | None, typer.Option(
        "--cascade", help="SMALL,LARGE: two served models (same tokenizer); the "
        "model 'cascade' answers with SMALL and escalates to LARGE when SMALL's confidence "
        "is below --cascade-threshold or its answer fails its check.",
        rich_help_panel="Many models")] = None
    cascade_threshold: Annotated[float, typer.Option(
        "--cascade-threshold", help="Escalate below this confidence (a probability, "
        "0 to 1; the chapter's example is 0.8).", rich_help_panel="Many models")] = 0.5
    cascade_confidence: Annotated[str, typer.Option(
        "--cascade-confidence", help="min-prob (the answer's lowest top-1 token "
        "probability) or mean-prob (exp of its mean log-probability).",
        rich_help_panel="Many models")] = "min-prob"
    cascade_name: Annotated[str, typer.Option(
        "--cascade-name", help="The model name clients ask for to use the "
        "cascade.", rich_help_panel="Many models")] = "cascade"


@with_settings(repeated=("model",))
@with_options(ServeOptions)
def serve(opts: ServeOptions, settings: SettingsRequest = SettingsRequest(),
          log_level: str = "warning") -> None:
    """Serve a model through an OpenAI-compatible API."""
    from kvdeck.runtime.fleet.publisher import KVEventsConfig
    from kvdeck.runtime.server.app import ServeLimits
    from kvdeck.runtime.server.serve import ApiServer

    def build():
        log_path = setup_logging(log_level, to_stderr=not opts.with_console)
        check_int("--port", opts.port, 0, 65535)
        check_int("--default-max-tokens", opts.default_max_tokens, 1, 1 << 24)
        for name, value in (("--request-timeout", opts.request_timeout),
                            ("--shutdown-timeout", opts.shutdown_timeout),
                            ("--read-timeout", opts.read_timeout)):
            check_float(name, value, 0.0, 1e6)
        if opts.read_timeout <= 0:
            raise ConfigError(f"--read-timeout must be greater than 0, got "
                              f"{opts.read_timeout}.")
        events = KVEventsConfig.parse(opts.kv_events_config) if opts.kv_events_config \
            else None
        knobs = {"threshold": opts.cascade_threshold, "measure": opts.cascade_confidence,
                 "name": opts.cascade_name}
        sessions, chosen = build_models(settings, events, opts.cascade, knobs,
                                        opts.lora_modules or [])
        supervisor.record(executor=sessions[0].settings.executor, log=str(log_path),
                          drain_s=str(opts.shutdown_timeout))
        return sessions, chosen

    sessions, chosen = guarded(build)
    session = sessions[0]
    limits = ServeLimits(read_timeout_s=opts.read_timeout,
                         request_timeout_s=opts.request_timeout or None,
                         default_max_tokens=opts.default_max_tokens,
                         metrics_need_key=opts.metrics_require_key)
    serving = {"host": opts.host, "port": opts.port, "api_key": opts.api_key,
               "limits": limits, "shutdown_timeout_s": opts.shutdown_timeout,
               "header_timeout_s": opts.read_timeout, "others": tuple(sessions[1:]),
               "cascade": chosen}
    if opts.with_console:
        from kvdeck.console.app import KvdeckApp

        # The console owns the engine loop; the HTTP server runs beside it in a thread.
        console_app = KvdeckApp(session.engine, settings=session.settings)
        server = ApiServer(session, loop=console_app.loop, **serving)
        if chosen is not None:
            console_app.routing = server.app.app.state.cascade.view
        server.start()
        console_app.before_shutdown.append(server.stop)
        console_app.run()
        return
    server = ApiServer(session, **serving)
    # soft_wrap: one logical line each, not cut at 80 columns in a log or a pipe.
    for s in sessions:
        out.print(settings_line(s), highlight=False, soft_wrap=True)
        if s.adapters:
            out.print("  LoRA adapters: " + ", ".join(f"{name} ({path})" for name, path
                                                      in s.adapters.items()),
                      highlight=False, soft_wrap=True)
    names = [s.model_id for s in sessions] + ([chosen.name] if chosen else [])
    server.run(on_listening=lambda p: out.print(
        f"serving {', '.join(names)} on http://{opts.host}:{p}/v1", highlight=False,
        soft_wrap=True))


def build_models(settings: SettingsRequest, events, cascade: str | None, knobs: dict,
                 lora_modules: list[str]) -> tuple[list, object]:
    """The sessions of every --model (one without it) with their LoRA adapters, the cascade
    over two of them (`knobs`: its threshold, measure and name) and the KV-events
    publisher; ConfigError, with every session built so far closed, for what cannot be
    served."""
    from kvdeck.runtime.fleet.publisher import EventPublisher
    from kvdeck.runtime.server.cascade import CascadeConfig
    from kvdeck.runtime.session import parse_lora_modules

    requests = settings.each("model")
    if len(requests) > 1:
        refuse_for_many(requests, events)
    if cascade:
        CascadeConfig.check_knobs(knobs["threshold"], knobs["measure"])
    parse_lora_modules(lora_modules)  # a malformed one is refused before any model loads
    sessions = build_sessions(requests)
    try:
        ids = [s.model_id for s in sessions]
        twice = [i for i in ids if ids.count(i) > 1]
        if twice:
            raise ConfigError(f"Two of the models would be served as {twice[0]!r}; give each "
                              "--model a different model.")
        if lora_modules:
            if len(sessions) > 1:
                raise ConfigError("--lora-modules adapts one base model; serve one --model "
                                  "with it.")
            sessions[0].load_adapters(lora_modules)
        chosen = cascade_config(sessions, cascade, knobs) if cascade else None
        if events is not None and events.publishes:
            publisher = EventPublisher(events, sessions[0].engine.kv.block_size).start()
            publisher.attach(sessions[0].engine)
    except BaseException:
        for s in sessions:
            s.close()
        raise
    return sessions, chosen


def cascade_config(sessions: list, cascade: str, knobs: dict):
    """`--cascade SMALL,LARGE` over the served sessions; ConfigError where the small model
    computes no logits or the two read text differently."""
    from kvdeck.runtime.server.cascade import CascadeConfig, same_tokenizer

    config = CascadeConfig.parse(cascade, [s.model_id for s in sessions], **knobs)
    small = next(s for s in sessions if s.model_id == config.small)
    large = next(s for s in sessions if s.model_id == config.large)
    if not small.executor.info.computes_logits:
        raise ConfigError(f"The cascade reads {config.small}'s confidence from its logits, "
                          f"and the {small.settings.executor} executor computes none; serve "
                          "real models.")
    if not same_tokenizer(small.tokenizer, large.tokenizer):
        raise ConfigError(f"The cascade's models {config.small} and {config.large} read text "
                          "with different tokenizers; a cascade hands one prompt to both, "
                          "so they must share one.")
    return config


def refuse_for_many(requests, events) -> None:
    """ConfigError for what serves one engine only, asked of several."""
    if any((r.flags or {}).get("served_model_name") for r in requests):
        raise ConfigError("--served-model-name names one model; with several --model "
                          "flags each is served under its own name.")
    if events is not None and events.publishes:
        raise ConfigError("--kv-events-config publishes one engine's events; serve one "
                          "model to publish them.")
    names = [(r.flags or {}).get("model") for r in requests]
    if len(set(names)) < len(names):
        raise ConfigError(f"--model names the same model twice ({', '.join(names)}); each "
                          "model is served once.")


def build_sessions(requests) -> list:
    """One session per model, each from the same settings but its model; a failure closes
    those already built."""
    from kvdeck.runtime.session import build_session

    sessions = []
    try:
        for r in requests:
            sessions.append(build_session(r.resolve("auto"), live=True))
    except BaseException:
        for s in sessions:
            s.close()
        raise
    return sessions

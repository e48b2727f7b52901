"""The `kvdeck` command line.

Each command is a thin shell over `runtime/`: it parses options, calls the runtime, and
prints. Errors a user can cause arrive as `KvdeckError` and are printed as one sentence with
exit code 2, never as a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from runtime.config import check_int
from runtime.errors import ConfigError, KvdeckError

app = typer.Typer(
    name="kvdeck",
    help="A terminal operator console hosting a local LLM inference runtime.",
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


@app.callback(invoke_without_command=True)
def root(ctx: typer.Context) -> None:
    """kvdeck: watch and tune a local LLM inference runtime, replay its runs, serve its API.

    Without a command, opens the console on the embedded default model with traffic flowing.
    """
    if ctx.invoked_subcommand is None:
        open_console()


@app.command()
def console(
    executor: str = typer.Option("torch", "--executor", help="torch (a real model) or sim."),
    model: str = typer.Option(None, "--model", help="Model name or GGUF path (torch)."),
    hardware: str = typer.Option("rtx-pro-6000", "--hardware", help="Hardware profile (sim)."),
    model_profile: str = typer.Option("qwen3-8b", "--model-profile",
                                      help="Model profile (sim)."),
    kv_memory_gib: float = typer.Option(None, "--kv-memory-gib",
                                        help="KV pool budget (default: 0.5 torch, 16 sim)."),
    rate: float = typer.Option(None, "--rate", help="Arrivals per second (traffic)."),
    pace: float = typer.Option(1.0, "--pace", help="Sim: virtual seconds per wall second."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype (torch)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (torch)."),
    seed: int = typer.Option(0, "--seed", help="Seed for traffic and sampling."),
) -> None:
    """Open the operator console on a live engine with built-in traffic."""
    open_console(executor, model, hardware, model_profile, kv_memory_gib, rate, pace, device,
                 dtype, threads, seed)


def open_console(executor: str = "torch", model: str | None = None,
                 hardware: str = "rtx-pro-6000", model_profile: str = "qwen3-8b",
                 kv_memory_gib: float | None = None, rate: float | None = None,
                 pace: float = 1.0, device: str = "auto", dtype: str | None = None,
                 threads: int | None = None, seed: int = 0) -> None:
    """Build an engine with built-in traffic and run the console (plain defaults, so the
    bare `kvdeck` can call it)."""
    from console.app import KvdeckApp
    from runtime.config import EngineConfig, Knobs
    from runtime.engine import Engine
    from runtime.executors.factory import make_executor
    from runtime.executors.sim import SimConfig
    from runtime.traffic import TrafficGenerator, TrafficMix

    def build():
        sim = SimConfig(model_profile=model_profile, hardware=hardware)
        ex = make_executor(executor, model=model, device=device, dtype=dtype, threads=threads,
                           seed=seed, sim_config=sim)
        gib = kv_memory_gib if kv_memory_gib is not None else (16 if executor == "sim" else 0.5)
        knobs = Knobs(max_num_batched_tokens=8192 if executor == "sim" else 512,
                      chunk_size=2048 if executor == "sim" else 256)
        cfg = EngineConfig(kv_memory_bytes=int(gib * 2**30), seed=seed, knobs=knobs,
                           kv_format="bf16" if executor == "sim" else "fp16")
        tokenizer = None
        if executor != "sim":
            from runtime.tokenizer import Tokenizer

            tokenizer = Tokenizer(ex.model_path)
        engine = Engine(cfg, ex, tokenizer=tokenizer)
        vocab = sim.vocab_size if executor == "sim" else ex.cfg.info.vocab_size
        default_rate = 3.0 if executor == "sim" else 0.5
        mix = TrafficMix.for_context(min(engine.max_model_len, 32768),
                                     rate if rate is not None else default_rate)
        if executor != "sim":  # a laptop CPU: keep requests short enough to watch
            mix = TrafficMix(rate_per_s=mix.rate_per_s, short_prompt=48, short_output=24,
                             long_prompt=192, shared_prefix=160, long_output=24)
        return engine, TrafficGenerator(engine, mix, vocab, seed=seed)

    engine, traffic = guarded(build)
    KvdeckApp(engine, traffic, pace=pace if executor == "sim" else None).run()


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


@app.command("run-trace")
def run_trace(
    trace: str = typer.Argument(..., help="Arrival trace: kvdeck/Mooncake JSONL or Azure CSV."),
    config: str = typer.Option(None, "--config", help="TOML file of engine settings."),
    executor: str = typer.Option("sim", "--executor", help="Executor: sim or torch."),
    model: str = typer.Option(None, "--model", help="Model name or GGUF path (torch)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(None, "--dtype",
                              help="fp32, bf16, fp16, int8, int8-head (default per device)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch."),
    record: str = typer.Option(None, "--record", help="Write a run directory here."),
    as_json: bool = typer.Option(False, "--json", help="Print summary and every request."),
    output: str = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    fmt: str = typer.Option("auto", "--format", help="auto, kvdeck, mooncake or azure."),
    limit: int = typer.Option(None, "--limit", help="Run only the first N requests."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="Multiply inter-arrival times (0.5 = twice the rate)."),
    hash_block_tokens: int = typer.Option(512, "--hash-block-tokens",
                                          help="Tokens per Mooncake hash id."),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
    slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
    slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
) -> None:
    """Run an arrival trace through the engine headless and summarize it."""
    from console.run_views import render_summary
    from runtime.config import read_toml
    from runtime.engine import Engine
    from runtime.executors.factory import make_executor
    from runtime.metrics import SLO
    from runtime.recording import Recorder
    from runtime.runner import configs_from_settings, run_arrivals
    from runtime.trace import load_arrivals

    def go() -> dict:
        check_int("--hash-block-tokens", hash_block_tokens, 1, 1 << 20)
        if limit is not None:
            check_int("--limit", limit, 1, 1 << 30)
        settings = read_toml(config) if config else {}
        engine_cfg, sim_cfg = configs_from_settings(settings)
        slo = SLO(slo_ttft, slo_tpot, slo_e2e)
        arrivals = load_arrivals(trace, fmt, limit=limit, time_scale=time_scale)
        ex = make_executor(executor, model=model, device=device, dtype=dtype, threads=threads,
                           seed=engine_cfg.seed, sim_config=sim_cfg)
        vocab = sim_cfg.vocab_size if executor == "sim" else ex.cfg.info.vocab_size
        engine = Engine(engine_cfg, ex)
        recorder = Recorder(record, engine) if record else None
        try:
            result = run_arrivals(engine, arrivals, vocab_size=vocab,
                                  hash_block_tokens=hash_block_tokens, slo=slo,
                                  on_arrival=recorder.arrival if recorder else None)
        finally:
            if recorder:
                recorder.close()
        result["trace"] = str(trace)
        result["settings"] = settings
        return result

    result = guarded(go)
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    if as_json:
        print_json(result)
    else:
        render_summary(out, f"{trace} on {result['summary']['model']}", result["summary"])
        if record:
            out.print(f"run recorded in {record}")


@app.command()
def calibrate(
    model: str = typer.Argument(..., help="Model name or GGUF path."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype (default per device)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads."),
    quick: bool = typer.Option(False, "--quick", help="A small sweep (seconds, not minutes)."),
    name: str = typer.Option(None, "--name", help="Profile name (default: the model name)."),
    as_json: bool = typer.Option(False, "--json", help="Print points and fit as JSON."),
) -> None:
    """Time a sweep of steps on a real model, fit the sim executor's step model, save it."""
    from rich.table import Table

    from runtime.calibrate import (
        fit_step_model,
        hardware_name,
        measure_machine,
        sweep,
        write_profiles,
    )
    from runtime.executors.factory import make_executor

    ex = guarded(lambda: make_executor("torch", model=model, device=device, dtype=dtype,
                                       threads=threads))
    say = (lambda msg: None) if as_json else out.print
    say(f"calibrating {ex.model_name} on {ex.device} ({ex.dtype_name})")
    points = sweep(ex, quick=quick, progress=say)
    fit = fit_step_model(points)
    bandwidth, flops = measure_machine()
    profile = name or Path(str(ex.model_path)).stem
    hw = hardware_name(ex)
    model_file, hw_file = write_profiles(ex, fit, profile, hw, bandwidth, flops)
    rows = [{"point": p.label, "measured_ms": p.seconds * 1e3,
             "fit_ms": fit.seconds(p.new_tokens, p.pairs) * 1e3} for p in points]
    for r in rows:
        r["error_pct"] = 100 * (r["fit_ms"] - r["measured_ms"]) / r["measured_ms"]
    if as_json:
        print_json({"fit": {"fixed_ms": fit.fixed_s * 1e3, "per_token_us": fit.per_token_s * 1e6,
                            "per_pair_ns": fit.per_pair_s * 1e9}, "points": rows,
                    "model_profile": str(model_file), "hardware_profile": str(hw_file)})
        return
    table = Table(title=f"step = {fit.fixed_s * 1e3:.3f} ms + {fit.per_token_s * 1e6:.2f} µs × "
                        f"tokens + {fit.per_pair_s * 1e9:.4f} ns × pairs")
    for col in ("point", "measured ms", "fit ms", "error"):
        table.add_column(col, justify="left" if col == "point" else "right")
    for r in rows:
        table.add_row(r["point"], f"{r['measured_ms']:.2f}", f"{r['fit_ms']:.2f}",
                      f"{r['error_pct']:+.1f}%")
    out.print(table)
    out.print(f"wrote {model_file} and {hw_file}; use them with the sim executor: "
              f'model_profile = "{profile}", hardware = "{hw}"')


@app.command()
def serve(
    model: str = typer.Option(None, "--model", help="Model name or GGUF path."),
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Bind address; anything but loopback is an explicit choice."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY'."),
    kv_memory_gib: float = typer.Option(0.5, "--kv-memory-gib", help="KV pool budget."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype."),
    threads: int = typer.Option(None, "--threads", help="CPU threads."),
    max_waiting: int = typer.Option(256, "--max-waiting",
                                    help="Waiting-queue bound; beyond it requests get 429."),
    with_console: bool = typer.Option(False, "--console",
                                      help="Open the console on the serving engine."),
) -> None:
    """Serve the model through an OpenAI-compatible API (completions, chat, streaming)."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.executors.factory import make_executor
    from runtime.server.serve import ApiServer
    from runtime.tokenizer import Tokenizer

    def build() -> tuple[Engine, Tokenizer, str]:
        check_int("--port", port, 1, 65535)
        ex = make_executor("torch", model=model, device=device, dtype=dtype, threads=threads)
        tok = Tokenizer(ex.model_path)
        engine = Engine(EngineConfig(kv_memory_bytes=int(kv_memory_gib * 2**30),
                                     max_waiting=max_waiting), ex, tokenizer=tok)
        return engine, tok, model or Path(str(ex.model_path)).stem

    engine, tok, name = guarded(build)
    if with_console:
        from console.app import KvdeckApp

        # The console owns the engine loop; the HTTP server runs beside it in a thread.
        console_app = KvdeckApp(engine)
        server = ApiServer(engine, tok, name, host=host, port=port, api_key=api_key,
                           loop=console_app.loop).start()
        try:
            console_app.run()
        finally:
            server.stop()
        return
    server = ApiServer(engine, tok, name, host=host, port=port, api_key=api_key)
    out.print(f"serving {server.engine.executor.model_name} on http://{host}:{port}/v1")
    server.run()


@app.command()
def bench(
    trace: str = typer.Argument(None, help="Arrival trace (JSONL/CSV); omit for synthetic."),
    url: str = typer.Option("http://127.0.0.1:8000/v1", "--url",
                            help="OpenAI-compatible base URL."),
    model: str = typer.Option("gemma3-270m", "--model", help="Model id the server serves."),
    api_key: str = typer.Option(None, "--api-key", help="Bearer key, if the server needs one."),
    in_process: bool = typer.Option(False, "--in-process",
                                    help="Run against an engine in this process, no HTTP."),
    limit: int = typer.Option(None, "--limit", help="Send only the first N requests."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Multiply inter-arrival times."),
    rate: float = typer.Option(2.0, "--rate", help="Synthetic: requests per second."),
    burstiness: float = typer.Option(1.0, "--burstiness",
                                     help="Synthetic: gamma shape (1 = Poisson, <1 bursty)."),
    num_requests: int = typer.Option(32, "--num-requests", help="Synthetic: how many."),
    prompt_len: int = typer.Option(256, "--prompt-len", help="Synthetic: mean prompt tokens."),
    output_len: int = typer.Option(64, "--output-len", help="Synthetic: mean output tokens."),
    max_prompt_len: int = typer.Option(None, "--max-prompt-len", help="Cap traced prompts."),
    max_output_len: int = typer.Option(None, "--max-output-len", help="Cap traced outputs."),
    vocab_size: int = typer.Option(32_000, "--vocab-size",
                                   help="Token ids for synthetic prompts stay below this."),
    as_json: bool = typer.Option(False, "--json", help="Print summary and every request."),
    output: str = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
    slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
    slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
) -> None:
    """Send a trace (or synthetic Poisson/gamma load) to a server and report TTFT, TPOT, ITL,
    E2E, throughput and goodput with vLLM's serving-benchmark definitions."""
    import asyncio
    import dataclasses

    from rich.progress import Progress

    from console.run_views import render_summary
    from runtime.loadgen import run_bench
    from runtime.metrics import SLO
    from runtime.trace import load_arrivals, synthetic_arrivals

    def arrivals():
        if trace is None:
            return synthetic_arrivals(num_requests, rate, burstiness=burstiness,
                                      prompt_len=prompt_len, output_len=output_len)
        got = load_arrivals(trace, limit=limit, time_scale=time_scale)
        return [dataclasses.replace(
            a, prompt_len=min(a.prompt_len, max_prompt_len or a.prompt_len),
            output_len=min(a.output_len, max_output_len or a.output_len),
            hash_ids=a.hash_ids[: -(-(max_prompt_len or a.prompt_len) // 512)]
            if a.hash_ids else None,
            prompt_tokens=a.prompt_tokens[:max_prompt_len] if a.prompt_tokens and
            max_prompt_len else a.prompt_tokens) for a in got]

    items = guarded(arrivals)
    slo = guarded(lambda: SLO(slo_ttft, slo_tpot, slo_e2e))
    if in_process:
        from runtime.config import EngineConfig
        from runtime.engine import Engine
        from runtime.executors.factory import make_executor
        from runtime.runner import run_arrivals

        def local() -> dict:
            ex = make_executor("torch", model=model)
            return run_arrivals(Engine(EngineConfig(kv_memory_bytes=512 << 20), ex), items,
                                vocab_size=min(vocab_size, ex.cfg.info.vocab_size), slo=slo)

        result = guarded(local)
    else:
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task(f"{len(items)} requests → {url}", total=len(items))
            result = asyncio.run(run_bench(url, model, items, vocab_size=vocab_size,
                                           api_key=api_key, slo=slo,
                                           on_done=lambda _: progress.advance(task)))
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    if as_json:
        print_json(result)
    else:
        render_summary(out, f"kvdeck bench → {'in-process' if in_process else url}",
                       result["summary"])


@app.command()
def attach(url: str = typer.Argument(..., help="Base URL of a kvdeck, vLLM, SGLang or "
                                                "llama.cpp server, e.g. http://127.0.0.1:8000"),
           interval: float = typer.Option(1.0, "--interval", help="Seconds between scrapes.")
           ) -> None:
    """Watch a running server through its /metrics: queue, KV usage, prefix hits, latency."""
    from console.screens.attach import AttachApp

    AttachApp(url, interval_s=interval).run()


@app.command()
def replay(run: str = typer.Argument(..., help="A run directory written by recording.")) -> None:
    """Open a recorded run in the console's panels, with play/pause, speed and a scrubber."""
    from console.screens.replay import ReplayApp

    guarded(lambda: ReplayApp(run)).run()


@app.command()
def compare(
    a: str = typer.Argument(..., help="Result JSON of run-trace --json (A)."),
    b: str = typer.Argument(..., help="Result JSON of run-trace --json (B)."),
) -> None:
    """Print two run-trace results side by side with deltas."""
    from console.run_views import render_compare

    def load(path: str) -> dict:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"Result file {p} does not exist.") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"Result file {p} is not valid JSON ({e.msg}).") from None
        if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
            raise ConfigError(f"Result file {p} has no 'summary'; write it with "
                              "kvdeck run-trace --json or --output.")
        return data["summary"]

    sa, sb = guarded(lambda: load(a)), guarded(lambda: load(b))
    render_compare(out, a, sa, b, sb)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

"""The `kvdeck` command line.

Each command is a thin shell over `runtime/`: it parses options, asks `kvdeck.runtime.session` for
an engine built from the layered settings (executor defaults, `--config`, flags), runs it,
and prints. Errors a user can cause arrive as `KvdeckError` and are printed as one sentence
with exit code 2, never as a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from kvdeck.console import supervisor
from kvdeck.console.model_report import human_bytes
from kvdeck.console.options import SettingsRequest, with_log_level, with_settings
from kvdeck.runtime.core.config import check_float, check_int
from kvdeck.runtime.errors import ConfigError, EngineFailedError, KvdeckError
from kvdeck.runtime.logs import setup_logging

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


def settings_line(session) -> str:
    """The settings a command runs with, in one line (printed at start-up)."""
    snap = session.engine.snapshot()
    k = snap.knobs
    slots = getattr(session.executor, "n_parallel", None)
    # llama.cpp splits the pool evenly over its slots: say where a longer context comes from.
    per_slot = f" (the pool over {slots} slots; fewer --n-parallel or more --kv-memory-gib " \
        "for longer)" if slots else ""
    return (f"{snap.model_name} on {snap.executor}: {snap.kv.num_blocks:,} KV blocks of "
            f"{snap.kv.block_size} tokens ({snap.kv.kv_format}), context "
            f"{session.engine.max_model_len:,}{per_slot}, "
            f"max_num_seqs {k.max_num_seqs}, max_num_batched_tokens "
            f"{k.max_num_batched_tokens}, chunk_size {k.chunk_size}, prefix caching "
            f"{'on' if k.enable_prefix_caching else 'off'}, weights {k.weight_format}"
            + weights_lines(snap) + transfers_line(snap) + speculation_line(snap)
            + (f"\n  executor: {session.settings.executor_choice}"
               if session.settings.executor_choice else ""))


def speculation_line(snap) -> str:
    """Speculative decoding and the draft model, when either is configured."""
    v, k = snap.speculation, snap.knobs
    if v is None or (k.speculative_method == "off" and not v.draft_model):
        return ""
    text = f"speculation {k.speculative_method}"
    if k.speculative_method != "off":
        text += f", k = {k.num_speculative_tokens} ({k.draft_length})"
    if v.draft_model:
        kv = snap.kv
        text += (f", draft model {v.draft_model} (twin KV {human_bytes(kv.draft_bytes_per_block)}"
                 f" per block beside {human_bytes(kv.bytes_per_block)})")
    return f"\n  {text}"


def transfers_line(snap) -> str:
    """The host tier, preemption mode and weight offload, when any is configured."""
    t, k = snap.transfers, snap.knobs
    parts = []
    if t is not None and t.host_blocks:
        parts.append(f"host KV tier {t.host_blocks:,} blocks, preemption {k.preemption}, "
                     f"prefix demotion {'on' if k.demote_prefixes else 'off'}")
    if t is not None and t.offload:
        parts.append(f"offload {t.offload.replace('; ', ', ')}")
    if t is not None and parts:
        parts.append(f"link {t.link_detail}")
    return "".join(f"\n  {p}" for p in parts)


def weights_lines(snap) -> str:
    """The weights' bytes and, when the start-up micro-benchmark ran, its figures."""
    w = snap.weights
    if w is None:
        return ""
    text = f" ({human_bytes(w.resident_bytes)}{'; ' + w.detail if w.detail else ''})"
    for line in w.kernels:
        text += f"\n  measured {line}"
    return text


RATE_HELP = ("Built-in traffic: arrivals per second (default 0.5 on a real model, 3 "
             "simulated).")


@app.callback(invoke_without_command=True)
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


@app.command()
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


@app.command()
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


@app.command()
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


@app.command("run-trace")
@with_settings
def run_trace(
    trace: str = typer.Argument(..., help="Arrival trace: a kvdeck/Mooncake JSONL or Azure CSV "
                                "file, or a sample's name (azure-conv, azure-code, "
                                "mooncake-conversation)."),
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
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Run an arrival trace through the engine headless (sim executor by default) and
    summarize it."""
    from kvdeck.console.run_views import render_summary
    from kvdeck.runtime.runs.recording import record_headless
    from kvdeck.runtime.runs.runner import needs_tokenizer, run_arrivals
    from kvdeck.runtime.runs.trace import load_arrivals
    from kvdeck.runtime.session import build_session
    from kvdeck.runtime.views.metrics import SLO

    def go() -> dict:
        setup_logging(log_level)
        check_int("--hash-block-tokens", hash_block_tokens, 1, 1 << 20)
        if limit is not None:
            check_int("--limit", limit, 1, 1 << 30)
        resolved = settings.resolve("sim")
        slo = SLO(slo_ttft, slo_tpot, slo_e2e)
        arrivals = load_arrivals(trace, fmt, limit=limit, time_scale=time_scale)
        session = build_session(resolved, with_tokenizer=needs_tokenizer(arrivals))
        engine = session.engine
        recorder = record_headless(engine, record) if record else None
        try:
            result = run_arrivals(engine, arrivals, vocab_size=session.vocab_size,
                                  hash_block_tokens=hash_block_tokens, slo=slo,
                                  on_arrival=recorder.arrival if recorder else None)
        except KvdeckError:
            raise
        except Exception as e:  # noqa: BLE001 - an engine failure: one sentence and a log
            failure = engine.fail(e)
            raise EngineFailedError(f"The run stopped: {failure.message}; the traceback is in "
                                    f"{failure.log_path}.") from None
        finally:
            if recorder:
                recorder.close()
            session.close()
        result["trace"] = str(trace)
        result["config"] = config_report(session)
        return result

    result = guarded(go)
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    if as_json:
        print_json(result)
    else:
        render_summary(out, f"{trace} on {result['summary']['model']}", result["summary"])
        if result["summary"]["statuses"].get("rejected"):
            out.print("some requests were rejected; --json lists each one's reason")
        if record:
            out.print(f"run recorded in {record}")


def config_report(session) -> dict:
    """The resolved settings and the engine's config, as JSON (run-trace --json, and
    `GET /kvdeck/config` on a server)."""
    from kvdeck.runtime.server.app import config_json

    return config_json(session.settings, session.engine)


@app.command()
@with_log_level
def quality(
    model: str = typer.Argument(None, help="Model name or GGUF path (default: the embedded "
                                "model)."),
    weights: str = typer.Option("bf16,int8,int4", "--weights",
                                help="Weight formats to measure, comma-separated."),
    kv: str = typer.Option("fp16,bf16,fp8_e4m3,q8_0,q4_0", "--kv",
                           help="KV formats to measure, comma-separated."),
    threads: int = typer.Option(None, "--threads", help="CPU threads."),
    int8_group_size: int = typer.Option(64, "--int8-group-size",
                                        help="Inputs per int8 scale (0: per channel)."),
    int4_group_size: int = typer.Option(32, "--int4-group-size",
                                        help="Inputs per int4 scale and zero."),
    weight_activations: str = typer.Option("measured", "--weight-activations",
                                           help="measured, fp32, bf16 or fp16."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
    log_level: str = "warning",
) -> None:
    """Measure what weight and KV formats cost in accuracy against fp32 weights with fp32 KV
    (teacher-forced top-1 agreement and mean |Δlogit| over a fixed text, identical greedy
    tokens on three prompts), on the CPU. Figures are cached per model and format; the
    console shows them beside the weight_format and kv_format knobs."""
    from dataclasses import asdict

    from kvdeck.runtime.kv.formats import KV_FORMATS
    from kvdeck.runtime.models.weight_formats import FORMATS
    from kvdeck.runtime.text.quality import measure_formats
    from kvdeck.runtime.text.tokenizer import Tokenizer

    def build():
        setup_logging(log_level)
        from kvdeck.runtime.executors.torch import TorchExecutor
        from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

        w = tuple(x for x in weights.split(",") if x)
        k = tuple(x for x in kv.split(",") if x)
        for x in w:
            if x not in FORMATS or x in ("auto", "dense"):
                raise KvdeckError(f"--weights names {x!r}; measurable weight formats are "
                                  f"{', '.join(f for f in FORMATS if f not in ('auto', 'dense'))}.")
        for x in k:
            if x not in KV_FORMATS:
                raise KvdeckError(f"--kv names {x!r}; KV formats are {', '.join(KV_FORMATS)}.")
        path = resolve_model(model or DEFAULT_MODEL)
        ex = TorchExecutor(path, device="cpu", dtype="fp32", threads=threads,
                           int8_group_size=int8_group_size, int4_group_size=int4_group_size,
                           weight_activations=weight_activations)
        return ex, Tokenizer(path), w, k

    ex, tok, w, k = guarded(build)
    if not as_json:
        out.print(f"measuring {ex.model_name} against fp32 weights + fp32 KV (cached figures "
                  "are reused)…", highlight=False)
    results = guarded(lambda: measure_formats(ex, tok, w, k))
    ex.close()
    if as_json:
        print_json([asdict(q) for q in results])
        return
    for q in results:
        where = ", ".join(f"{p} ({m:.3f})" for p, m in q.disagreements[:3])
        out.print(q.line() + (f"; first disagreements at position (reference margin): "
                              f"{where}" if where else ""), highlight=False)


@app.command()
@with_log_level
def calibrate(
    model: str = typer.Argument(..., help="Model name or GGUF path."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype (default per device)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads."),
    quick: bool = typer.Option(False, "--quick", help="A small sweep (seconds, not minutes)."),
    name: str = typer.Option(None, "--name", help="Profile name (default: the model name)."),
    as_json: bool = typer.Option(False, "--json", help="Print points and fit as JSON."),
    log_level: str = "warning",
) -> None:
    """Time a sweep of steps on a real model, fit the sim executor's step model, save it."""
    from rich.table import Table

    from kvdeck.runtime.executors.link import measure_link
    from kvdeck.runtime.planning.calibrate import (
        fit_step_model,
        hardware_name,
        sweep,
        write_profiles,
    )
    from kvdeck.runtime.planning.machine import measure_machine
    from kvdeck.runtime.planning.profiles import HardwareProfile
    from kvdeck.runtime.session import build_executor
    from kvdeck.runtime.settings import resolve

    def build():
        setup_logging(log_level)
        return build_executor(resolve({"executor": "torch", "model": model, "device": device,
                                       "dtype": dtype, "threads": threads}))

    ex = guarded(build)
    say = (lambda msg: None) if as_json else out.print
    say(f"calibrating {ex.model_name} on {ex.device} ({ex.dtype_name})")
    points = sweep(ex, quick=quick, progress=say)
    fit = fit_step_model(points)
    bandwidth, flops = measure_machine(str(ex.device))
    link = measure_link(ex.device).bandwidth
    profile = name or Path(str(ex.model_path)).stem
    hw = hardware_name(ex)
    model_file, hw_file = write_profiles(ex, fit, profile, hw, bandwidth, flops, points, link)
    measured = HardwareProfile.load(hw)
    rows = [{"point": p.label, "measured_ms": p.seconds * 1e3,
             "fit_ms": fit.seconds(p.new_tokens, p.pairs, p.sampled) * 1e3} for p in points]
    for r in rows:
        r["error_pct"] = 100 * (r["fit_ms"] - r["measured_ms"]) / r["measured_ms"]
    if as_json:
        print_json({"fit": {"fixed_ms": fit.fixed_s * 1e3, "per_token_us": fit.per_token_s * 1e6,
                            "per_pair_ns": fit.per_pair_s * 1e9,
                            "per_sample_us": fit.per_sample_s * 1e6}, "points": rows,
                    "model_profile": str(model_file), "hardware_profile": str(hw_file),
                    "mfu": measured.mfu, "mbu": measured.mbu,
                    "bandwidth_bytes_per_s": bandwidth, "peak_flops": flops,
                    "link_bytes_per_s": link})
        return
    table = Table(title=f"step = {fit.fixed_s * 1e3:.3f} ms + {fit.per_token_s * 1e6:.2f} µs × "
                        f"tokens + {fit.per_pair_s * 1e9:.4f} ns × pairs + "
                        f"{fit.per_sample_s * 1e6:.2f} µs × sampled rows")
    for col in ("point", "measured ms", "fit ms", "error"):
        table.add_column(col, justify="left" if col == "point" else "right")
    for r in rows:
        table.add_row(r["point"], f"{r['measured_ms']:.2f}", f"{r['fit_ms']:.2f}",
                      f"{r['error_pct']:+.1f}%")
    out.print(table)
    out.print(f"peaks measured here: {bandwidth / 1e9:.1f} GB/s read, {flops / 1e9:.1f} GFLOP/s "
              f"matmul, link {link / 1e9:.1f} GB/s; this model reached MFU {measured.mfu:.3f} "
              f"and MBU {measured.mbu:.3f}", highlight=False)
    out.print(f"wrote {model_file} and {hw_file}; use them with the sim executor: "
              f'model_profile = "{profile}", hardware = "{hw}"')


@app.command()
@with_log_level
def plan(
    hardware: str = typer.Option("rtx-pro-6000", "--hardware",
                                 help="Hardware profile (profiles/hardware/ or your own)."),
    model: str = typer.Option("qwen3-8b", "--model",
                              help="Model profile, a model name or a GGUF path."),
    workload: str = typer.Option("long-burst", "--workload",
                                 help="Workload profile (profiles/workloads/)."),
    kv_budget: float = typer.Option(None, "--kv-budget",
                                    help="GiB for KV and auxiliary buffers (default: the "
                                         "card's memory less the weights, less 10 %)."),
    deadline: float = typer.Option(None, "--deadline",
                                   help="Completion deadline in seconds (default: the "
                                        "workload's)."),
    draft: list[str] = typer.Option(None, "--draft",
                                    help="Draft source(s) to price (profiles/drafts/); "
                                         "default every one that fits the model; 'none' for "
                                         "no speculation."),
    block_size: int = typer.Option(16, "--block-size", help="KV block size in tokens."),
    max_batched_tokens: int = typer.Option(8192, "--max-batched-tokens",
                                           help="Token budget per step (prefill chunks)."),
    timing: str = typer.Option("auto", "--timing",
                               help="auto (the fitted step model where the profile has one), "
                                    "fit or roofline."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    svg: Path = typer.Option(None, "--svg", help="Write the memory-vs-completion plane here."),
    log_level: str = "warning",
) -> None:
    """Plan before running: KV capacity, TTFT, completion time and cost of every scheme
    (shared prefix, KV formats, speculation, weight offload), which limit each breaks, and
    the cheapest feasible one."""
    from kvdeck.console.plan_report import plan_json, plane_points, render_plan
    from kvdeck.console.plane import render_svg
    from kvdeck.runtime.planning.planner import Planner
    from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
    from kvdeck.runtime.planning.workloads import DraftSource, Workload, draft_sources

    guarded(lambda: setup_logging(log_level))
    guarded(lambda: check_int("--block-size", block_size, 1, 256))
    guarded(lambda: check_int("--max-batched-tokens", max_batched_tokens, 1, 1 << 20))
    if timing not in ("auto", "fit", "roofline"):
        fail(f"--timing must be auto, fit or roofline, got {timing!r}.")
    hw = guarded(lambda: HardwareProfile.load(hardware))
    mp = guarded(lambda: ModelProfile.load(model))
    wl = guarded(lambda: Workload.load(workload))
    if timing == "fit" and hw.name not in mp.fits:
        fail(f"Model profile {mp.name} has no fitted step model for {hw.name}; use --timing "
             "roofline, or kvdeck calibrate on that card.")
    if kv_budget is None:
        budget = (hw.memory_bytes - mp.weight_bytes) * 0.9
        if budget <= 0:
            fail(f"{mp.name}'s weights ({mp.weight_bytes / 2**30:.1f} GiB) do not fit "
                 f"{hw.name}'s memory ({hw.memory_bytes / 2**30:.1f} GiB); give --kv-budget.")
    else:
        guarded(lambda: check_float("--kv-budget", kv_budget, 1e-6, 1e6))
        budget = kv_budget * 2**30
    if deadline is not None:
        guarded(lambda: check_float("--deadline", deadline, 1e-6, 1e6))
    if draft and "none" in draft:
        drafts = []
    elif draft:
        drafts = [guarded(lambda name=name: DraftSource.load(name)) for name in draft]
        for d in drafts:
            if not d.fits(mp):
                fail(f"Draft source {d.name} drafts for {d.target}, not {mp.name}.")
    else:
        drafts = guarded(lambda: draft_sources(mp))
    planner = Planner(hw, mp, wl, budget, deadline, drafts, block_size, max_batched_tokens,
                      timing)
    result = planner.plan()
    if svg is not None:
        title = f"{mp.name} on {hw.name}, {wl.name}: memory vs completion"
        try:
            svg.write_text(render_svg(plane_points(result), budget / 2**30, planner.deadline,
                                      title))
        except OSError as e:
            fail(f"Cannot write the SVG to {svg}: {e.strerror}.")
    if as_json:
        print_json(plan_json(planner, result))
        return
    render_plan(out, planner, result)
    if svg is not None:
        out.print(f"wrote {svg}")


@app.command()
@with_settings
def sweep(
    trace: str = typer.Argument(None, help="Arrival trace (JSONL/CSV) or a sample's name; "
                                "omit for synthetic Poisson arrivals."),
    rates: str = typer.Option(None, "--rates",
                              help="Comma-separated arrival rates (req/s) to run; default "
                                   "0.05–1× a trace's own rate, or 0.5–16 synthetic."),
    limit: int = typer.Option(200, "--limit", help="Use the first N requests of a trace."),
    num_requests: int = typer.Option(200, "--num-requests", help="Synthetic: how many."),
    prompt_len: int = typer.Option(1024, "--prompt-len", help="Synthetic: mean prompt tokens."),
    output_len: int = typer.Option(256, "--output-len", help="Synthetic: mean output tokens."),
    slo_ttft: float = typer.Option(2.0, "--slo-ttft", help="TTFT SLO in seconds."),
    slo_tpot: float = typer.Option(0.08, "--slo-tpot", help="TPOT SLO in seconds."),
    slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
    check_cap: bool = typer.Option(True, "--check-cap/--no-check-cap",
                                   help="Re-run the rates past the knee with the recommended "
                                        "cap (in-process only)."),
    url: str = typer.Option(None, "--url", help="Sweep a running server (OpenAI-compatible "
                            "base URL) instead of an engine in this process."),
    hash_block_tokens: int = typer.Option(512, "--hash-block-tokens",
                                          help="Tokens per Mooncake hash id."),
    as_json: bool = typer.Option(False, "--json", help="Print every point as JSON."),
    svg: Path = typer.Option(None, "--svg", help="Write the goodput chart here."),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Run one workload at increasing arrival rates (sim executor by default) and report
    completion throughput and goodput per rate, the knee where goodput peaks, and the cap on
    requests in the engine (--max-waiting) that holds goodput past it."""
    import asyncio

    from kvdeck.console.sweep_report import render_sweep, sweep_svg
    from kvdeck.runtime.planning.sweep import DEFAULT_SCALES, offered_rate
    from kvdeck.runtime.planning.sweep import sweep as run_sweep
    from kvdeck.runtime.runs.loadgen import RequestShape, run_bench
    from kvdeck.runtime.runs.runner import run_arrivals
    from kvdeck.runtime.runs.trace import load_arrivals, synthetic_arrivals
    from kvdeck.runtime.session import build_session
    from kvdeck.runtime.views.metrics import SLO

    def inputs():
        setup_logging(log_level)
        check_int("--limit", limit, 2, 1 << 30)
        check_int("--num-requests", num_requests, 2, 1 << 30)
        check_int("--prompt-len", prompt_len, 1, 1 << 20)
        check_int("--output-len", output_len, 1, 1 << 20)
        if trace is None:
            base = synthetic_arrivals(num_requests, 1.0, prompt_len=prompt_len,
                                      output_len=output_len)
            defaults = (0.5, 1, 2, 4, 6, 8, 12, 16)
        else:
            base = load_arrivals(trace, limit=limit)
            rate = offered_rate(base)
            if not 0 < rate < float("inf"):
                raise ConfigError(f"The trace {trace} has no spread of arrival times to scale; "
                                  "it needs at least two requests at different times.")
            defaults = tuple(s * rate for s in DEFAULT_SCALES)
        if rates is None:
            return base, defaults
        try:
            chosen = tuple(float(r) for r in rates.split(","))
        except ValueError:
            raise ConfigError(f"--rates must be comma-separated numbers of requests per "
                              f"second, got {rates!r}.") from None
        if len(set(chosen)) < 2 or len(set(chosen)) != len(chosen) or \
                any(not 0 < r < 1e6 for r in chosen):
            raise ConfigError(f"--rates needs at least two different rates, each above 0, "
                              f"got {rates!r}.")
        return base, chosen

    arrivals, chosen = guarded(inputs)
    slo = guarded(lambda: SLO(slo_ttft, slo_tpot, slo_e2e))

    def in_process(items, cap):
        fixed = {"max_waiting": cap} if cap else {}
        session = build_session(settings.resolve("sim", **fixed), with_tokenizer=False)
        try:
            return run_arrivals(session.engine, items, vocab_size=session.vocab_size, slo=slo,
                                hash_block_tokens=hash_block_tokens)["summary"]
        finally:
            session.close()

    def remote(items, cap):
        model = (settings.flags or {}).get("model", "gemma3-270m")
        got = asyncio.run(run_bench(url, model, items, slo=slo,
                                    shape=RequestShape(32_000, hash_block_tokens)))
        answered = [r for r in got["requests"] if r["status"] != "rejected"]
        if not answered:  # a wrong URL or model name: say why instead of charting zeros
            raise ConfigError(f"Every request to {url} was refused; the first: "
                              f"{got['requests'][0]['reason']}")
        return got["summary"]

    say = (lambda msg: None) if as_json else (lambda msg: err.print(msg, highlight=False))
    result = guarded(lambda: run_sweep(remote if url else in_process, arrivals, chosen,
                                       check_cap=check_cap and url is None, progress=say))
    title = f"sweep of {trace or 'synthetic Poisson arrivals'} ({len(arrivals)} requests)" \
        f"{' → ' + url if url else ''}"
    if svg is not None:
        try:
            svg.write_text(sweep_svg(result, title))
        except OSError as e:
            fail(f"Cannot write the SVG to {svg}: {e.strerror}.")
    if as_json:
        print_json(result.to_json() | {"slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot,
                                               "e2e_s": slo_e2e}})
        return
    render_sweep(out, title, result)
    if svg is not None:
        out.print(f"wrote {svg}")


@app.command(help="Serve a model through an OpenAI-compatible API (completions, chat, "
             "streaming).\n\nWith --executor sim the API answers with a simulated card's "
             "timing, paced to the wall clock, for testing clients, load generators and "
             "dashboards without the card.")
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
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Serve a model through an OpenAI-compatible API."""
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
        session = build_session(settings.resolve("auto"), live=True)
        supervisor.record(executor=session.settings.executor, log=str(log_path))
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


@app.command()
@with_settings
def bench(
    trace: str = typer.Argument(None, help="Arrival trace (JSONL/CSV) or a sample's name; "
                                "omit for synthetic arrivals."),
    url: str = typer.Option("http://127.0.0.1:8000/v1", "--url",
                            help="OpenAI-compatible base URL."),
    api_key: str = typer.Option(None, "--api-key", help="Bearer key, if the server needs one."),
    in_process: bool = typer.Option(False, "--in-process",
                                    help="Run against an engine in this process, no HTTP "
                                         "(the engine flags apply)."),
    limit: int = typer.Option(None, "--limit", help="Send only the first N requests."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Multiply inter-arrival times."),
    rate: float = typer.Option(2.0, "--rate", help="Synthetic: requests per second."),
    burstiness: float = typer.Option(1.0, "--burstiness",
                                     help="Synthetic: gamma shape (1 = Poisson, <1 bursty)."),
    num_requests: int = typer.Option(32, "--num-requests", help="Synthetic: how many."),
    prompt_len: int = typer.Option(256, "--prompt-len", help="Synthetic: mean prompt tokens."),
    output_len: int = typer.Option(64, "--output-len", help="Synthetic: mean output tokens."),
    length_spread: float = typer.Option(0.5, "--length-spread",
                                        help="Synthetic: lengths uniform within ± this "
                                             "fraction of the means (0: exact)."),
    concurrency: int = typer.Option(None, "--concurrency",
                                    help="At most N requests in flight (vLLM's "
                                         "--max-concurrency); a request's clock starts when "
                                         "it is sent."),
    text_prompts: bool = typer.Option(False, "--text-prompts",
                                      help="Send prompts as text: windows of a built-in "
                                           "English passage, --prompt-len tokens by --model's "
                                           "tokenizer (for servers that take no token ids, "
                                           "e.g. llama-cpp-python's)."),
    exact_length_field: str = typer.Option("ignore_eos", "--exact-length-field",
                                           help="How requests ask for exactly their output "
                                                "length: ignore_eos (kvdeck, vLLM, SGLang) "
                                                "or min_tokens (llama-cpp-python)."),
    max_prompt_len: int = typer.Option(None, "--max-prompt-len", help="Cap traced prompts."),
    max_output_len: int = typer.Option(None, "--max-output-len", help="Cap traced outputs."),
    vocab_size: int = typer.Option(32_000, "--vocab-size",
                                   help="Token ids for synthetic prompts stay below this."),
    hash_block_tokens: int = typer.Option(512, "--hash-block-tokens",
                                          help="Tokens per Mooncake hash id."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                help="Send one uncounted short request first."),
    retries: int = typer.Option(0, "--retries",
                                help="Send a request again, up to N times, while its answer "
                                     "fails its check (a trace's \"check\") or it errors; "
                                     "reports the retries and the time to a correct answer "
                                     "(from the first send). Retries help only where answers "
                                     "vary: see --temperature."),
    temperature: float = typer.Option(0.0, "--temperature",
                                      help="Sampling temperature of every request; above 0, "
                                           "each send carries its own seed, so a run is "
                                           "reproducible and a retry draws a new answer."),
    send_checks: bool = typer.Option(False, "--send-checks",
                                     help="Also send each trace check as kvdeck's \"check\" "
                                          "field, so a kvdeck server counts it in its own "
                                          "goodput (/metrics)."),
    as_json: bool = typer.Option(False, "--json", help="Print summary and every request."),
    output: str = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
    slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
    slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Send a trace (or synthetic Poisson/gamma load) to a server and report TTFT, TPOT, ITL,
    E2E, throughput and goodput with vLLM's serving-benchmark definitions; requests that
    carry a check count as good only when their answer passes it. --model names the model
    the server serves (default gemma3-270m)."""
    import asyncio

    from rich.progress import Progress

    from kvdeck.console.run_views import render_summary
    from kvdeck.runtime.runs.loadgen import (
        EXACT_LENGTH_FIELDS,
        MAX_RETRIES,
        RequestShape,
        cap_arrivals,
        run_bench,
    )
    from kvdeck.runtime.runs.trace import load_arrivals, synthetic_arrivals
    from kvdeck.runtime.views.metrics import SLO

    def arrivals():
        setup_logging(log_level)
        if trace is None:
            return synthetic_arrivals(num_requests, rate, burstiness=burstiness,
                                      prompt_len=prompt_len, output_len=output_len,
                                      spread=length_spread)
        got = load_arrivals(trace, limit=limit, time_scale=time_scale)
        return cap_arrivals(got, max_prompt_len, max_output_len, hash_block_tokens)

    items = guarded(arrivals)
    slo = guarded(lambda: SLO(slo_ttft, slo_tpot, slo_e2e))
    if concurrency is not None:
        guarded(lambda: check_int("--concurrency", concurrency, 1, 1 << 16))
    guarded(lambda: check_int("--retries", retries, 0, MAX_RETRIES))
    guarded(lambda: check_float("--temperature", temperature, 0.0, 2.0))
    if exact_length_field not in EXACT_LENGTH_FIELDS:
        fail(f"--exact-length-field must be one of {', '.join(EXACT_LENGTH_FIELDS)}, got "
             f"{exact_length_field!r}.")
    if in_process and (concurrency or text_prompts or exact_length_field != "ignore_eos"
                       or retries or temperature or send_checks):
        fail("--concurrency, --text-prompts, --exact-length-field, --retries, --temperature "
             "and --send-checks shape HTTP requests; with --in-process, cap running requests "
             "with --max-num-seqs.")
    if in_process:
        from kvdeck.runtime.runs.runner import needs_tokenizer, run_arrivals
        from kvdeck.runtime.session import build_session

        def local() -> dict:
            session = build_session(settings.resolve("torch"),
                                    with_tokenizer=needs_tokenizer(items))
            try:
                return run_arrivals(session.engine, items,
                                    vocab_size=min(vocab_size, session.vocab_size), slo=slo,
                                    hash_block_tokens=hash_block_tokens)
            finally:
                session.close()

        result = guarded(local)
    else:
        model = (settings.flags or {}).get("model", "gemma3-270m")

        def shape() -> RequestShape:
            text = None
            if text_prompts:
                from kvdeck.runtime.models.registry import resolve_model
                from kvdeck.runtime.runs.loadgen import passage_prompts
                from kvdeck.runtime.text.tokenizer import Tokenizer

                text = passage_prompts(Tokenizer(resolve_model(model)))
            return RequestShape(vocab_size, hash_block_tokens, text, exact_length_field,
                                temperature, send_checks)

        request_shape = guarded(shape)
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task(f"{len(items)} requests → {url}", total=len(items))
            result = asyncio.run(run_bench(url, model, items, shape=request_shape,
                                           api_key=api_key, slo=slo, concurrency=concurrency,
                                           warmup=warmup, retries=retries,
                                           on_done=lambda _: progress.advance(task)))
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    if as_json:
        print_json(result)
    else:
        render_summary(out, f"kvdeck bench → {'in-process' if in_process else url}",
                       result["summary"])


@app.command()
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


@app.command()
@with_log_level
def replay(run: str = typer.Argument(..., help="A run directory written by recording."),
           summary: bool = typer.Option(False, "--summary",
                                        help="Print the run's figures (as run-trace does) "
                                             "instead of opening the console."),
           as_json: bool = typer.Option(False, "--json", help="With --summary: as JSON."),
           slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
           slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
           slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
           log_level: str = "warning") -> None:
    """Open a recorded run in the console's panels, with play/pause, speed and a scrubber;
    or, with --summary, print its figures computed from the records alone."""
    guarded(lambda: setup_logging(log_level, to_stderr=False))
    if summary:
        from kvdeck.console.run_views import render_summary
        from kvdeck.runtime.runs.replay import summarize_run
        from kvdeck.runtime.views.metrics import SLO

        result = guarded(lambda: summarize_run(run, SLO(slo_ttft, slo_tpot, slo_e2e)))
        if as_json:
            print_json(result)
        else:
            render_summary(out, f"replay of {run} on {result['model']}", result)
            if result["unfinished"]:
                out.print(f"{result['unfinished']} requests had not finished when the "
                          "recording stopped; the figures cover the finished ones")
        return
    from kvdeck.console.screens.replay import ReplayApp

    app = guarded(lambda: ReplayApp(run))
    app.run()
    if app.problem is not None:  # a record the replay could not apply
        fail(app.problem)


@app.command()
@with_log_level
def compare(
    a: str = typer.Argument(..., help="Result JSON of run-trace --json (A)."),
    b: str = typer.Argument(..., help="Result JSON of run-trace --json (B)."),
    log_level: str = "warning",
) -> None:
    """Print two run-trace results side by side with deltas."""
    from kvdeck.console.run_views import render_compare

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

    guarded(lambda: setup_logging(log_level))
    sa, sb = guarded(lambda: load(a)), guarded(lambda: load(b))
    render_compare(out, a, sa, b, sb)


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

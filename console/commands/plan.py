"""`kvdeck plan` (capacity, latency and cost of every scheme) and `kvdeck sweep` (goodput by
arrival rate)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import typer

from kvdeck.console.commands.common import err, fail, guarded, out, print_json
from kvdeck.console.options import SettingsRequest, with_log_level, with_settings
from kvdeck.runtime.core.config import check_float, check_int
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.logs import setup_logging


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
                                         "card's memory less the weights, less 10 %, "
                                         "less --graph-buckets' replay memory)."),
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
                               help="auto (the card's measured decode steps where the model "
                                    "profile has them, else its fitted step model, else the "
                                    "roofline), measured, fit or roofline."),
    graph_buckets: str = typer.Option("", "--graph-buckets",
                                      help="Execution shapes: CUDA-graph batch sizes, like "
                                           "1,2,4,8,16,32; a step pads its rows to the next."),
    layouts: str = typer.Option("auto", "--layouts",
                                help="Parallel layouts of one replica to plan, like "
                                     "TP1,TP2,TP4xPP2 (cards are a cost); auto: one card "
                                     "where the weights fit it, else TP 1/2/4/8 and PP2."),
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

    guarded(lambda: setup_logging(log_level))
    _check_steps(block_size, max_batched_tokens, timing)
    hw, mp, wl = _profiles(hardware, model, workload, timing)
    from kvdeck.runtime.planning import layouts as lay

    chosen = guarded(lambda: lay.parse_layouts(layouts))
    if layouts.strip() == "auto" and lay.fits_one_card(mp, hw):
        chosen = (lay.Layout(),)
    if chosen != (lay.Layout(),):
        _plan_layouts(chosen, hw, mp, wl, kv_budget, deadline, draft, block_size,
                      max_batched_tokens, timing, graph_buckets, as_json, svg)
        return
    from kvdeck.runtime.planning.step_time import graph_reserve, parse_buckets

    buckets = guarded(lambda: parse_buckets(graph_buckets))
    budget = _kv_budget(kv_budget, hw, mp, graph_reserve(mp, buckets, wl.final_tokens))
    if deadline is not None:
        guarded(lambda: check_float("--deadline", deadline, 1e-6, 1e6))
    planner = Planner(hw, mp, wl, budget, deadline, _drafts(draft, mp), block_size,
                      max_batched_tokens, timing, buckets)
    result = planner.plan()
    if svg is not None:
        title = f"{mp.name} on {hw.name}, {wl.name}: memory vs completion"
        _write_svg(svg, lambda: render_svg(plane_points(result), budget / 2**30,
                                           planner.deadline, title))
    if as_json:
        print_json(plan_json(planner, result))
        return
    render_plan(out, planner, result)
    if svg is not None:
        out.print(f"wrote {svg}")


def _plan_layouts(chosen, hw, mp, wl, kv_budget, deadline, draft, block_size,
                  max_batched_tokens, timing, graph_buckets, as_json, svg) -> None:
    """`kvdeck plan` over parallel layouts (`runtime/planning/layouts.py`)."""
    from kvdeck.console.plan_report import layouts_json, render_layouts, render_plan
    from kvdeck.runtime.planning import layouts as lay
    from kvdeck.runtime.planning.planner import Planner
    from kvdeck.runtime.planning.step_time import graph_reserve, parse_buckets

    if kv_budget is not None:
        fail("--kv-budget is one card's; over layouts each gets what its cards leave at 90 % "
             "of their memory, so leave --kv-budget out or give --layouts TP1.")
    if svg is not None:
        fail("--svg draws one layout's plane; give --layouts with one layout for it.")
    if deadline is not None:
        guarded(lambda: check_float("--deadline", deadline, 1e-6, 1e6))
    buckets = guarded(lambda: parse_buckets(graph_buckets))
    drafts = _drafts(draft, mp)
    plans = guarded(lambda: lay.plan_layouts(
        lambda layout, budget: Planner(hw, mp, wl, budget, deadline, drafts, block_size,
                                       max_batched_tokens, timing, buckets, layout),
        chosen, mp, hw, graph_reserve(mp, buckets, wl.final_tokens)))
    verdict = lay.verdict(plans, mp, hw)
    best = lay.cheapest(plans)
    if as_json:
        print_json(layouts_json(plans, verdict, best))
        return
    render_layouts(out, plans, verdict)
    if best is not None:
        out.print()
        out.print(f"the plan at {best.layout.name}:")
        render_plan(out, best.planner, best.plan)


def _check_steps(block_size: int, max_batched_tokens: int, timing: str) -> None:
    """One sentence and exit 2 for a step size out of its range or an unknown timing."""
    from kvdeck.runtime.planning.planner import TIMINGS

    guarded(lambda: check_int("--block-size", block_size, 1, 256))
    guarded(lambda: check_int("--max-batched-tokens", max_batched_tokens, 1, 1 << 20))
    if timing not in TIMINGS:
        fail(f"--timing must be {', '.join(TIMINGS[:-1])} or {TIMINGS[-1]}, got {timing!r}.")


def _profiles(hardware: str, model: str, workload: str, timing: str) -> tuple:
    """The hardware, model and workload profiles named; exit 2 where `--timing fit` asks
    for a step model the model profile has not fitted on that card."""
    from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
    from kvdeck.runtime.planning.workloads import Workload

    hw = guarded(lambda: HardwareProfile.load(hardware))
    mp = guarded(lambda: ModelProfile.load(model))
    wl = guarded(lambda: Workload.load(workload))
    if timing == "fit" and hw.name not in mp.fits:
        fail(f"Model profile {mp.name} has no fitted step model for {hw.name}; use --timing "
             "roofline, or kvdeck calibrate on that card.")
    if timing == "measured" and not mp.decode_times.get(hw.name):
        fail(f"Model profile {mp.name} has no measured decode steps on {hw.name}; use "
             "--timing fit or roofline, or kvdeck calibrate on that card.")
    return hw, mp, wl


def _kv_budget(kv_budget: float | None, hw, mp, reserve: int) -> float:
    """Bytes for KV and auxiliary buffers: `--kv-budget` GiB, or the card's memory less the
    weights, less 10 %, less `reserve` (CUDA graphs' replay memory, which the chapter
    counts outside the KV budget, as `--kv-budget` is)."""
    if kv_budget is not None:
        guarded(lambda: check_float("--kv-budget", kv_budget, 1e-6, 1e6))
        return kv_budget * 2**30
    budget = (hw.memory_bytes - mp.weight_bytes) * 0.9 - reserve
    if budget <= 0:
        fail(f"{mp.name}'s weights ({mp.weight_bytes / 2**30:.1f} GiB) do not fit "
             f"{hw.name}'s memory ({hw.memory_bytes / 2**30:.1f} GiB); give --kv-budget.")
    return budget


def _drafts(draft: list[str] | None, mp) -> list:
    """The draft sources to price: those `--draft` names (none for 'none'), else every one
    that drafts for the model."""
    from kvdeck.runtime.planning.workloads import DraftSource, draft_sources

    if draft and "none" in draft:
        return []
    if not draft:
        return guarded(lambda: draft_sources(mp))
    drafts = [guarded(lambda name=name: DraftSource.load(name)) for name in draft]
    for d in drafts:
        if not d.fits(mp):
            fail(f"Draft source {d.name} drafts for {d.target}, not {mp.name}.")
    return drafts


def _write_svg(path: Path, render: Callable[[], str]) -> None:
    """Write the SVG `render()` returns to `path`; one sentence and exit 2 if it cannot."""
    try:
        path.write_text(render())
    except OSError as e:
        fail(f"Cannot write the SVG to {path}: {e.strerror}.")


BATCH_OPTION = typer.Option(
    None, "--batch", help="Sweep batch sizes instead (e.g. 1,4,16,64): each many --prompt-len/"
    "--output-len requests at once; throughput, TTFT, ITL, bytes and MBU of a full decode step.")
ADMISSION_OPTION = typer.Option(
    None, "--admission", help="Sweep each admission mode over the rates (e.g. one-at-a-time,"
    "continuous,all-at-once): goodput per mode and rate.")


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
    batch: str = BATCH_OPTION,
    admission: str = ADMISSION_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print every point as JSON."),
    svg: Path = typer.Option(None, "--svg", help="Write the goodput chart here."),
    replicas: str = typer.Option(None, "--replicas", help="Sweep simulated fleets: replica "
                                 "counts like 1,2,4, each with every --router; the knee per "
                                 "fleet.", rich_help_panel="Fleet"),
    router: list[str] = typer.Option(None, "--router", help="With --replicas: a router "
                                     "(repeat for several; default round-robin).",
                                     rich_help_panel="Fleet"),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Run one workload at increasing arrival rates (sim executor by default) and report
    completion throughput and goodput per rate, the knee where goodput peaks, and the cap on
    requests in the engine (--max-waiting) that holds goodput past it. --batch and
    --admission run the chapter's batch-size and admission-mode sweeps instead; --replicas
    and --router sweep simulated fleets.

    Long because its options are its signature (typer reads them there)."""
    from kvdeck.console.commands import sweep_modes
    from kvdeck.console.sweep_report import render_sweep, sweep_svg
    from kvdeck.runtime.planning.sweep import sweep as run_sweep
    from kvdeck.runtime.stats.metrics import SLO

    sweep_modes.refuse_mixed(batch, admission, trace, rates, url, svg)
    if batch:
        guarded(lambda: setup_logging(log_level))
        sweep_modes.run_batches(batch, prompt_len, output_len, settings, as_json)
        return

    def inputs():
        setup_logging(log_level)
        check_int("--limit", limit, 2, 1 << 30)
        check_int("--num-requests", num_requests, 2, 1 << 30)
        check_int("--prompt-len", prompt_len, 1, 1 << 20)
        check_int("--output-len", output_len, 1, 1 << 20)
        base, defaults = _synthetic(num_requests, prompt_len, output_len) if trace is None \
            else _traced(trace, limit)
        return base, (defaults if rates is None else _parse_rates(rates))

    arrivals, chosen = guarded(inputs)
    slo = guarded(lambda: SLO(slo_ttft, slo_tpot, slo_e2e))
    if replicas is not None or router:
        _sweep_fleets(replicas or "1", router or ["round-robin"], arrivals, chosen, settings,
                      slo, hash_block_tokens, url, admission, as_json, svg,
                      f"fleet sweep of {trace or 'synthetic Poisson arrivals'} "
                      f"({len(arrivals)} requests)")
        return
    if admission:
        modes = guarded(lambda: sweep_modes.parse_modes(admission))
        in_process = functools.partial(_run_in_process, settings=settings, slo=slo,
                                       hash_block_tokens=hash_block_tokens)
        sweep_modes.run_modes(modes, arrivals, chosen,
                              lambda items, knobs: in_process(items, None, knobs=knobs),
                              f"sweep of {trace or 'synthetic Poisson arrivals'}", as_json)
        return
    # Both runners take what one run needs; a remote one also the server's URL.
    where = {"settings": settings, "slo": slo, "hash_block_tokens": hash_block_tokens}
    run = functools.partial(_run_remote, url=url, **where) if url else \
        functools.partial(_run_in_process, **where)
    say = (lambda msg: None) if as_json else (lambda msg: err.print(msg, highlight=False))
    result = guarded(lambda: run_sweep(run, arrivals, chosen,
                                       check_cap=check_cap and url is None, progress=say))
    title = f"sweep of {trace or 'synthetic Poisson arrivals'} ({len(arrivals)} requests)" \
        f"{' → ' + url if url else ''}"
    if svg is not None:
        _write_svg(svg, lambda: sweep_svg(result, title))
    if as_json:
        print_json(result.to_json() | {"slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot,
                                               "e2e_s": slo_e2e}})
        return
    render_sweep(out, title, result)
    if svg is not None:
        out.print(f"wrote {svg}")


def _sweep_fleets(replicas, routers, arrivals, rates, settings, slo, hash_block_tokens, url,
                  admission, as_json, svg, title) -> None:
    """`kvdeck sweep --replicas/--router`: one sweep per fleet configuration."""
    from kvdeck.console import sweep_fleet
    from kvdeck.runtime.cluster.routers import make_router

    if url or admission:
        fail("--replicas and --router sweep simulated fleets; they do not go with --url or "
             "--admission.")
    counts = guarded(lambda: sweep_fleet.parse_counts(replicas))
    for r in routers:
        guarded(lambda r=r: make_router(r))
    say = (lambda msg: None) if as_json else (lambda msg: err.print(msg, highlight=False))
    results = guarded(lambda: sweep_fleet.fleet_sweeps(settings, counts, routers, arrivals,
                                                       rates, slo, hash_block_tokens, say))
    if svg is not None:
        _write_svg(svg, lambda: sweep_fleet.fleet_sweeps_svg(results, title))
    if as_json:
        print_json(sweep_fleet.fleet_sweeps_json(results))
        return
    sweep_fleet.render_fleet_sweeps(out, title, results)
    if svg is not None:
        out.print(f"wrote {svg}")


def _synthetic(num_requests: int, prompt_len: int, output_len: int) -> tuple[list, tuple]:
    """Synthetic Poisson arrivals at 1 req/s, and the rates to run them at by default."""
    from kvdeck.runtime.runs.trace import synthetic_arrivals

    base = synthetic_arrivals(num_requests, 1.0, prompt_len=prompt_len, output_len=output_len)
    return base, (0.5, 1, 2, 4, 6, 8, 12, 16)


def _traced(trace: str, limit: int) -> tuple[list, tuple]:
    """A trace's first `limit` arrivals, and the rates to run them at by default (fractions
    of its own rate); ConfigError for a trace with no spread of arrival times."""
    from kvdeck.runtime.planning.sweep import DEFAULT_SCALES, offered_rate
    from kvdeck.runtime.runs.trace import load_arrivals

    base = load_arrivals(trace, limit=limit)
    rate = offered_rate(base)
    if not 0 < rate < float("inf"):
        raise ConfigError(f"The trace {trace} has no spread of arrival times to scale; "
                          "it needs at least two requests at different times.")
    return base, tuple(s * rate for s in DEFAULT_SCALES)


def _parse_rates(rates: str) -> tuple[float, ...]:
    """`--rates` as numbers; ConfigError unless there are two or more different ones, each
    above 0."""
    try:
        chosen = tuple(float(r) for r in rates.split(","))
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers of requests per "
                          f"second, got {rates!r}.") from None
    if len(set(chosen)) < 2 or len(set(chosen)) != len(chosen) or \
            any(not 0 < r < 1e6 for r in chosen):
        raise ConfigError(f"--rates needs at least two different rates, each above 0, "
                          f"got {rates!r}.")
    return chosen


def _run_in_process(items: list, cap: int | None, *, settings: SettingsRequest, slo,
                    hash_block_tokens: int, knobs: dict | None = None) -> dict:
    """The summary of `items` through a fresh engine in this process (sim by default),
    holding at most `cap` requests when one is given, with `knobs` over the settings'."""
    from kvdeck.runtime.runs.runner import run_arrivals
    from kvdeck.runtime.session import build_session

    fixed = {**(knobs or {}), **({"max_waiting": cap} if cap else {})}
    session = build_session(settings.resolve("sim", **fixed), with_tokenizer=False)
    try:
        return run_arrivals(session.engine, items, vocab_size=session.vocab_size, slo=slo,
                            hash_block_tokens=hash_block_tokens)["summary"]
    finally:
        session.close()


def _run_remote(items: list, cap: int | None, *, url: str, settings: SettingsRequest, slo,
                hash_block_tokens: int) -> dict:
    """The summary of `items` sent to the server at `url`; `cap` goes unused, as a remote
    server holds its own (--check-cap is in-process only)."""
    import asyncio

    from kvdeck.runtime.runs.loadgen import RequestShape, run_bench

    model = (settings.flags or {}).get("model", "gemma3-270m")
    got = asyncio.run(run_bench(url, model, items, slo=slo,
                                shape=RequestShape(32_000, hash_block_tokens)))
    answered = [r for r in got["requests"] if r["status"] != "rejected"]
    if not answered:  # a wrong URL or model name: say why instead of charting zeros
        raise ConfigError(f"Every request to {url} was refused; the first: "
                          f"{got['requests'][0]['reason']}")
    return got["summary"]

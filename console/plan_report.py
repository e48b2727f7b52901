"""`kvdeck plan`'s output: the worked figures, one row per scheme with its verdict, the
choice or what would make a scheme feasible, and the memory-vs-completion plane."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from kvdeck.console.plane import Point, marks, render_text
from kvdeck.runtime.planning.planner import Plan, Planner
from kvdeck.runtime.planning.schemes import SchemeResult

GIB = 2**30


def plane_points(plan: Plan) -> list[Point]:
    return [Point(r.scheme.name, r.memory_bytes / GIB, r.completion_s, r.feasible)
            for r in plan.results]


def _seconds(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.2f}"


def _joules(x: float) -> str:
    return "—" if math.isnan(x) else "∞" if math.isinf(x) else f"{x:,.0f}"


def plan_json(planner: Planner, plan: Plan) -> dict:
    w = planner.workload
    return {
        "hardware": planner.hw.name, "model": planner.model.name, "workload": w.name,
        "kv_budget_bytes": planner.budget, "deadline_s": planner.deadline,
        "arrival": w.arrival, "num_requests": w.num_requests, "rate_per_s": w.rate_per_s,
        "figures": plan.figures,
        "schemes": [r.to_json() for r in plan.results],
        "choice": plan.choice.scheme.name if plan.choice else None,
        "suggestions": plan.suggestions,
    }


def render_plan(out: Console, planner: Planner, plan: Plan, plane: bool = True) -> None:
    w, f = planner.workload, plan.figures
    arrival = f"{w.num_requests} at once" if w.arrival == "burst" else \
        f"Poisson {w.rate_per_s:g}/s"
    out.print(f"[bold]{planner.model.name}[/] on [bold]{planner.hw.description}[/], workload "
              f"[bold]{w.name}[/]: {w.prompt_tokens} in / {w.output_tokens} out, shared prefix "
              f"{w.shared_prefix_tokens}, {arrival}; KV budget {planner.budget / GIB:.2f} GiB, "
              f"deadline {planner.deadline:g} s; timing: {f['timing']}", highlight=False)
    window = f"; sliding window {f['sliding_window']} on {f['local_layers']} layers (counted " \
        "as the window)" if f["sliding_window"] else ""
    out.print(f"blocks of {f['block_size']}: {f['blocks_after_prefill']} per request after "
              f"prefill, {f['blocks_after_output']} after the output; {f['shared_blocks']} "
              f"shared prefix blocks{window}", highlight=False)
    step = f["decode_step_s"]
    models = " / ".join(f"{name} {step[name] * 1e3:.2f} ms"
                        for name in ("measured", "fit", "roofline") if step[name] is not None)
    out.print(f"decode step at batch {step['batch']}, context {step['context']}: {models}",
              highlight=False)
    if f["graph_buckets"]:
        out.print(f"CUDA graphs at {','.join(map(str, f['graph_buckets']))} rows: "
                  f"{f['graph_pool_bytes'] / 2**20:,.1f} MiB kept for replay (estimated: the "
                  "largest graph's live tensors as kvdeck's torch executor captures it), "
                  "outside the KV budget", highlight=False)
    figures = Table(title="per KV format")
    for col in ("format", "KV B/token", "GiB/request", "fit", "fit shared",
                "D(b,L) GB/step", "KV > weights at b ≥"):
        figures.add_column(col, justify="left" if col == "format" else "right")
    for name, v in f["formats"].items():
        shared = v["capacity_shared"]
        figures.add_row(name, f"{v['kv_bytes_per_token']:,}",
                        f"{v['bytes_per_request_full'] / GIB:.3f}", str(v["capacity"]),
                        "—" if shared is None else str(shared),
                        f"{v['read_bytes_per_decode_step'] / 1e9:.2f}",
                        str(v["crossover_batch"]))
    out.print(figures)
    table = Table(title="schemes")
    for col in ("", "scheme", "memory GiB", "TTFT s", "completion s", "acc-s/good",
                "J/good", "verdict"):
        table.add_column(col, justify="right" if col.endswith(("s", "GiB", "good")) else "left")
    for r, m in zip(plan.results, marks(plane_points(plan)), strict=True):
        style = "green" if r.feasible else "red"
        chosen = " [bold](chosen)[/]" if r is plan.choice else ""
        def bound(x: float, r: SchemeResult = r) -> str:  # a cost left out: lower bounds
            return ("≥" if r.unpriced and math.isfinite(x) else "") + _seconds(x)

        table.add_row(m, r.scheme.name, f"{r.memory_bytes / GIB:.2f}", bound(r.ttft_s),
                      bound(r.completion_s), bound(r.accelerator_s_per_good),
                      _joules(r.energy_j_per_good),
                      f"[{style}]{r.verdict()}[/]{chosen}")
    out.print(table)
    if plan.choice is not None:
        c = plan.choice
        energy = "" if math.isnan(c.energy_j_per_good) else \
            f" and {c.energy_j_per_good:,.0f} J"
        out.print(f"[bold green]choice:[/] {c.scheme.name} — {c.memory_bytes / GIB:.2f} GiB, "
                  f"completion {c.completion_s:.2f} s, {c.accelerator_s_per_good:.3f} "
                  f"accelerator-s{energy} per good result", highlight=False)
    elif any(r.feasible for r in plan.results):  # feasible only before an unpriced cost
        names = ", ".join(f"'{r.scheme.name}'" for r in plan.results if r.feasible)
        out.print(f"[bold yellow]no fully priced scheme is feasible;[/] {names} would be, "
                  "before a conversion cost not measured on this card (measure it, or see "
                  "below):", highlight=False)
        for s in plan.suggestions:
            out.print(f"  • {s}", highlight=False)
    else:
        out.print("[bold red]no scheme is feasible.[/] What would make one feasible:")
        for s in plan.suggestions:
            out.print(f"  • {s}", highlight=False)
    if plane:
        out.print()
        for line in render_text(plane_points(plan), planner.budget / GIB, planner.deadline):
            out.print(line, highlight=False, markup=False)


def layouts_json(plans: list, verdict: str, best) -> dict:
    """`kvdeck plan --json` over layouts: each layout's line, the verdict, the chosen
    layout's plan."""
    return {
        "layouts": [{"layout": p.layout.name, "cards": p.layout.cards,
                     "kv_budget_bytes": p.budget, "problem": p.problem or None,
                     "choice": p.plan.choice.scheme.name if p.plan and p.plan.choice else None,
                     "card_s_per_good": p.card_seconds,
                     "pipeline_bubble": p.layout.bubble()} for p in plans],
        "verdict": verdict,
        "plan": plan_json(best.planner, best.plan) if best is not None else None,
    }


def render_layouts(out: Console, plans: list, verdict: str) -> None:
    """One line per layout: cards, what they leave for KV, the choice or why none."""
    table = Table(title="layouts (one replica across tp × pp cards)")
    for col in ("layout", "cards", "KV budget GB", "bubble", "choice", "card-s / good"):
        table.add_column(col, justify="left" if col in ("layout", "choice") else "right")
    for p in plans:
        choice = "cannot hold the weights" if p.problem else (
            p.plan.choice.scheme.name if p.plan.choice is not None else "nothing feasible")
        table.add_row(p.layout.name, str(p.layout.cards),
                      f"{p.budget / 1e9:,.0f}" if not p.problem else "—",
                      f"{p.layout.bubble():.0%}", choice,
                      _seconds(p.card_seconds) if p.card_seconds is not None else "—")
    out.print(table)
    out.print(verdict)

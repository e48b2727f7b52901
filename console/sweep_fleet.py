"""`kvdeck sweep --replicas 1,2,4 --router R …`: the rate sweep once per fleet configuration
(replica count × router) on the simulated fleet, each configuration's knee, and goodput by
rate per configuration as a table, terminal bars and an SVG chart."""

from __future__ import annotations

from html import escape

from rich.console import Console
from rich.table import Table

from kvdeck.console.sweep_report import Chart
from kvdeck.runtime.cluster.replicas import ClusterConfig, replica_roles
from kvdeck.runtime.cluster.run import run_fleet
from kvdeck.runtime.core.config import check_int
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.sweep import SweepResult, sweep

BAR = 36
COLORS = ("#080", "#03c", "#c60", "#a0a", "#0aa", "#c00", "#666", "#884")


def parse_counts(text: str) -> list[int]:
    """`--replicas` as a list: comma-separated counts from 1 to 256."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts:
        raise ConfigError(f"--replicas takes comma-separated counts like 1,2,4; got {text!r}.")
    for n in counts:
        check_int("--replicas", n, 1, 256)
    return counts


def fleet_sweeps(settings, counts: list[int], routers: list[str], arrivals, rates, slo,
                 hash_block_tokens: int, progress=lambda _: None
                 ) -> list[tuple[str, SweepResult]]:
    """(configuration name, its sweep) for each replica count × router."""
    out = []
    for n in counts:
        for router in routers:
            config = ClusterConfig(router=router)
            name = f"{n} × {router}"

            def run(items, cap, n=n, config=config) -> dict:
                return run_fleet(settings.resolve("sim"), replica_roles(n, 0, 0), config,
                                 items, slo=slo, hash_block_tokens=hash_block_tokens)["summary"]

            progress(f"{name}:")
            out.append((name, sweep(run, arrivals, rates, check_cap=False, progress=progress)))
    return out


def fleet_sweeps_json(results: list[tuple[str, SweepResult]]) -> dict:
    return {"configs": [{"config": name, **r.to_json()} for name, r in results]}


def render_fleet_sweeps(out: Console, title: str, results: list[tuple[str, SweepResult]]
                        ) -> None:
    table = Table(title=title)
    for col in ("fleet", "knee rps", "goodput at knee", "completion at knee",
                "TTFT p99 at knee s"):
        table.add_column(col, justify="left" if col == "fleet" else "right")
    for name, r in results:
        k = r.knee_point
        table.add_row(name, f"{k.rate_rps:.3g}", f"{k.goodput_rps:.3f}",
                      f"{k.completion_rps:.3f}",
                      "—" if k.ttft_p99_s is None else f"{k.ttft_p99_s:.3f}")
    out.print(table)
    top = max([p.goodput_rps for _, r in results for p in r.points] + [1e-12])
    out.print("goodput by offered rate (█), per fleet", highlight=False)
    for name, r in results:
        out.print(name, highlight=False, markup=False)
        for i, p in enumerate(r.points):
            n = round(p.goodput_rps / top * BAR)
            mark = " ◀ knee" if i == r.knee else ""
            out.print(f"{p.rate_rps:>8.3g} │{'█' * n:<{BAR}} {p.goodput_rps:.3f}{mark}",
                      highlight=False, markup=False)


def fleet_sweeps_svg(results: list[tuple[str, SweepResult]], title: str) -> str:
    """Goodput against the offered rate, one line per fleet configuration, knees marked."""
    x_max = max(p.rate_rps for _, r in results for p in r.points) * 1.05
    y_max = max([p.goodput_rps for _, r in results for p in r.points] + [1e-12]) * 1.1
    chart = Chart(title, "goodput (req/s)", x_max, y_max)
    x, y, out = chart.x, chart.y, chart.out
    left, top, pw = chart.left, chart.top, chart.pw
    for j, (name, r) in enumerate(results):
        color = COLORS[j % len(COLORS)]
        pts = " ".join(f"{x(p.rate_rps):.1f},{y(p.goodput_rps):.1f}" for p in r.points)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        k = r.knee_point
        out.append(f'<circle cx="{x(k.rate_rps):.1f}" cy="{y(k.goodput_rps):.1f}" r="5" '
                   f'fill="{color}"/>')
        out.append(f'<text x="{left + pw - 230}" y="{top + 16 + 16 * j}" fill="{color}">'
                   f'{escape(name)} (knee {k.rate_rps:.3g} rps)</text>')
    return chart.svg()

"""`kvdeck sweep`'s output: a table per rate, a bar chart of completion throughput and
goodput by rate (goodput with the recommended cap beside it past the knee), and an SVG."""

from __future__ import annotations

from xml.sax.saxutils import escape

from rich.console import Console
from rich.table import Table

from kvdeck.runtime.planning.sweep import SweepResult

BAR = 40


def render_sweep(out: Console, title: str, result: SweepResult) -> None:
    capped = {p.rate_rps: p for p in result.capped}
    table = Table(title=title)
    for col in ("rate rps", "completion rps", "goodput rps", "good", "rejected",
                "in engine", "TTFT p99 s", f"goodput, cap {result.cap}"):
        table.add_column(col, justify="right")
    for i, p in enumerate(result.points):
        c = capped.get(p.rate_rps)
        knee = " [bold](knee)[/]" if i == result.knee else ""
        table.add_row(f"{p.rate_rps:.3g}{knee}", f"{p.completion_rps:.3f}",
                      f"{p.goodput_rps:.3f}", f"{p.num_good}/{p.num_requests}",
                      str(p.num_rejected), f"{p.mean_resident:.1f}",
                      "—" if p.ttft_p99_s is None else f"{p.ttft_p99_s:.2f}",
                      "" if c is None else f"{c.goodput_rps:.3f} ({c.num_rejected} rejected)")
    out.print(table)
    top = max([p.completion_rps for p in result.points] + [p.goodput_rps for p in result.capped]
              + [1e-12])
    out.print(f"█ goodput  ░ completions beyond it  ▓ goodput with at most {result.cap} in the "
              "engine", highlight=False)
    for i, p in enumerate(result.points):
        good = round(p.goodput_rps / top * BAR)
        done = max(good, round(p.completion_rps / top * BAR))
        mark = "◀ knee" if i == result.knee else ""
        out.print(f"{p.rate_rps:>8.3g} │{'█' * good}{'░' * (done - good):<{BAR - good}} "
                  f"{p.goodput_rps:.3f} {mark}", highlight=False, markup=False)
        c = capped.get(p.rate_rps)
        if c is not None:
            n = round(c.goodput_rps / top * BAR)
            out.print(f"{'':>8} │{'▓' * n:<{BAR}} {c.goodput_rps:.3f} capped", highlight=False,
                      markup=False)
    k = result.knee_point
    if k.goodput_rps == 0:
        out.print("[yellow]no request met the SLOs at any rate: loosen --slo-ttft / "
                  "--slo-tpot, or sweep lower rates; there is no knee and no cap to "
                  "recommend[/]")
        return
    if result.knee == len(result.points) - 1:
        out.print("[yellow]goodput still grows at the highest rate: no knee yet; add higher "
                  "--rates[/]")
    elif result.knee == 0:
        out.print("[yellow]goodput already falls past the lowest rate: add lower --rates to "
                  "see it rise[/]")
    out.print(f"knee: {k.rate_rps:.3g} rps offered, goodput {k.goodput_rps:.3f} rps, "
              f"{k.mean_resident:.1f} requests in the engine on average", highlight=False)
    if result.capped:
        verdict = "holds" if result.holds() else "does not hold"
        out.print(f"recommended cap: --max-waiting {result.cap} (requests in the engine, "
                  f"waiting and running); past the knee it {verdict} goodput at ≥ 90% of the "
                  "knee's", highlight=False)
    else:
        out.print(f"recommended cap: --max-waiting {result.cap} on a kvdeck server (requests "
                  "in the engine, waiting and running)", highlight=False)


class Chart:
    """A rate chart's frame: the plot area, axes with ticks, title and labels (the sweep's
    SVG charts share it)."""

    w, h, left, top, pw, ph = 760, 460, 70, 40, 560, 360

    def __init__(self, title: str, y_label: str, x_max: float, y_max: float):
        self.x_max, self.y_max = x_max, y_max
        left, top, pw, ph = self.left, self.top, self.pw, self.ph
        self.out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
            'font-family="monospace" font-size="12">',
            f'<rect width="{self.w}" height="{self.h}" fill="white"/>',
            f'<text x="{left}" y="22" font-size="14">{escape(title)}</text>',
            f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" '
            'stroke="black"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>',
            f'<text x="{left + pw / 2 - 70}" y="{top + ph + 34}">offered rate (req/s)</text>',
            f'<text x="18" y="{top + ph / 2}" transform="rotate(-90 18 {top + ph / 2})">'
            f'{escape(y_label)}</text>']
        for i in range(5):
            self.out.append(f'<text x="{self.x(x_max * i / 4) - 10:.1f}" y="{top + ph + 16}">'
                            f'{x_max * i / 4:.2g}</text>')
            self.out.append(f'<text x="{left - 45}" y="{self.y(y_max * i / 4) + 4:.1f}">'
                            f'{y_max * i / 4:.2g}</text>')

    def x(self, v: float) -> float:
        return self.left + v / self.x_max * self.pw

    def y(self, v: float) -> float:
        return self.top + self.ph - v / self.y_max * self.ph

    def svg(self) -> str:
        return "\n".join([*self.out, "</svg>"]) + "\n"


def sweep_svg(result: SweepResult, title: str) -> str:
    """Completion throughput, goodput and capped goodput against the offered rate; the knee
    as a dashed line."""
    x_max = max(p.rate_rps for p in result.points) * 1.05
    y_max = max([p.completion_rps for p in result.points]
                + [p.goodput_rps for p in result.capped] + [1e-12]) * 1.1
    chart = Chart(title, "req/s", x_max, y_max)
    x, y, top, ph = chart.x, chart.y, chart.top, chart.ph
    left, pw = chart.left, chart.pw

    def line(values: list[tuple[float, float]], color: str, dash: str = "") -> str:
        pts = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in values)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        dots = "".join(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{color}"/>'
                       for a, b in values)
        return f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"' \
               f'{extra}/>{dots}'

    knee = result.knee_point
    out = chart.out
    out += [f'<line x1="{x(knee.rate_rps):.1f}" y1="{top}" x2="{x(knee.rate_rps):.1f}" '
            f'y2="{top + ph}" stroke="#888" stroke-dasharray="6 4"/>',
            f'<text x="{x(knee.rate_rps) + 4:.1f}" y="{top + 12}" fill="#555">knee</text>']
    out.append(line([(p.rate_rps, p.completion_rps) for p in result.points], "#888"))
    out.append(line([(p.rate_rps, p.goodput_rps) for p in result.points], "#080"))
    if result.capped:
        out.append(line([(knee.rate_rps, knee.goodput_rps)]
                        + [(p.rate_rps, p.goodput_rps) for p in result.capped], "#03c", "5 3"))
    legend = [("#888", "completion throughput"), ("#080", "goodput"),
              ("#03c", f"goodput, at most {result.cap} in the engine")]
    for i, (color, label) in enumerate(legend):
        out.append(f'<text x="{left + pw - 250}" y="{top + 16 + 16 * i}" fill="{color}">'
                   f'{escape(label)}</text>')
    return chart.svg()


def render_batches(out: Console, title: str, points: list) -> None:
    """`kvdeck sweep --batch`: one row per batch size."""
    table = Table(title=title)
    for col in ("batch", "tok/s", "TTFT mean s", "ITL mean ms", "decode step ms",
                "GB read/step", "MBU"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(str(p.batch), f"{p.throughput_tps:,.1f}", f"{p.ttft_mean_s:.3f}",
                      f"{p.itl_mean_s * 1e3:.1f}",
                      "—" if p.decode_step_s is None else f"{p.decode_step_s * 1e3:.2f}",
                      "—" if p.bytes_per_step is None else f"{p.bytes_per_step / 1e9:.2f}",
                      "—" if p.mbu is None else f"{100 * p.mbu:.0f} %")
    out.print(table)


def render_modes(out: Console, title: str, result: dict) -> None:
    """`kvdeck sweep --admission`: goodput (and completions) per rate, one column per mode."""
    modes = list(result)
    table = Table(title=f"{title}: goodput rps (completion rps) by admission mode")
    table.add_column("rate rps", justify="right")
    for mode in modes:
        table.add_column(mode, justify="right")
    for i, first in enumerate(result[modes[0]]):
        table.add_row(f"{first.rate_rps:.3g}", *(
            f"{result[m][i].goodput_rps:.3f} ({result[m][i].completion_rps:.3f})"
            for m in modes))
    out.print(table)
    for mode in modes:
        best = max(result[mode], key=lambda p: p.goodput_rps)
        out.print(f"{mode}: best goodput {best.goodput_rps:.3f} rps at {best.rate_rps:.3g} "
                  "rps offered", highlight=False)

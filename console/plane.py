"""The memory-vs-completion-time plane of a plan: each scheme a point, the memory budget and
the deadline as dashed lines, drawn as text for a terminal and as an SVG file.

A point is `(label, memory GiB, completion s, feasible)`; infinite completion times (a queue
that grows without bound) are drawn at the top edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape

MARKS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


@dataclass(frozen=True)
class Point:
    label: str
    memory_gib: float
    completion_s: float
    feasible: bool
    measured: bool = False
    """The running engine's own point (drawn as `@`)."""


def _bounds(points: list[Point], budget: float, deadline: float) -> tuple[float, float]:
    finite = [p.completion_s for p in points if math.isfinite(p.completion_s)]
    x_max = max([p.memory_gib for p in points] + [budget]) * 1.08
    y_max = max(finite + [deadline]) * 1.08
    return max(x_max, 1e-9), max(y_max, 1e-9)


def marks(points: list[Point]) -> list[str]:
    """The character each point is drawn with (`@` for a measured one)."""
    out, i = [], 0
    for p in points:
        if p.measured:
            out.append("@")
        else:
            out.append(MARKS[i % len(MARKS)])
            i += 1
    return out


def render_text(points: list[Point], budget: float, deadline: float, width: int = 64,
                height: int = 18) -> list[str]:
    """Lines of a character plot: x memory (GiB), y completion (s); `¦` is the budget, `┄`
    the deadline; a point's letter is upper-left of the legend's."""
    x_max, y_max = _bounds(points, budget, deadline)
    grid = [[" "] * width for _ in range(height)]

    def col(x: float) -> int:
        return min(width - 1, max(0, round(x / x_max * (width - 1))))

    def row(y: float) -> int:
        y = y_max if not math.isfinite(y) else y
        return min(height - 1, max(0, height - 1 - round(y / y_max * (height - 1))))

    bx, dy = col(budget), row(deadline)
    for r in range(height):
        if r % 2 == 0:
            grid[r][bx] = "¦"
    for c in range(0, width, 2):
        grid[dy][c] = "┄"
    # The measured point last, over anything: it is what the operator compares against.
    for p, m in sorted(zip(points, marks(points), strict=True), key=lambda x: x[0].measured):
        r, c = row(p.completion_s), col(p.memory_gib)
        grid[r][c] = m if grid[r][c] in " ¦┄" or p.measured else "*"  # `*`: points overlap
    label_w = max(len(f"{y_max:.1f}"), 4)
    lines = []
    for r, cells in enumerate(grid):
        y = deadline if r == dy else y_max * (height - 1 - r) / (height - 1)
        tick = f"{y:.1f}" if r in (0, dy, height - 1) else ""
        lines.append(f"{tick:>{label_w}} │{''.join(cells)}")
    lines.append(" " * label_w + " └" + "─" * width)
    axis = f"0{'':<{max(0, bx - 1)}}{budget:.2f}"
    right = f"{x_max:.2f}"
    axis = axis[:width - len(right) - 1].ljust(width - len(right)) + right
    lines.append(" " * (label_w + 2) + axis)
    lines.append(" " * (label_w + 2) + f"x: memory (GiB), the budget {budget:.2f} at ¦; "
                 f"y: completion time (s), the deadline {deadline:g} at ┄")
    return lines


def render_svg(points: list[Point], budget: float, deadline: float, title: str) -> str:
    """An SVG of the plane: feasible points filled, infeasible hollow, a measured point as a
    diamond; dashed budget and deadline lines; each point labelled with its mark, and the
    legend beside the plot."""
    w, h, left, top, plot_w, plot_h = 980, 520, 70, 40, 520, 420
    x_max, y_max = _bounds(points, budget, deadline)

    def x(v: float) -> float:
        return left + v / x_max * plot_w

    def y(v: float) -> float:
        v = y_max if not math.isfinite(v) else v
        return top + plot_h - v / y_max * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="monospace" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{escape(title)}</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
           'stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>',
           f'<line x1="{x(budget):.1f}" y1="{top}" x2="{x(budget):.1f}" y2="{top + plot_h}" '
           'stroke="#c03" stroke-dasharray="6 4"/>',
           f'<text x="{x(budget) + 4:.1f}" y="{top + 12}" fill="#c03">budget '
           f'{budget:.1f} GiB</text>',
           f'<line x1="{left}" y1="{y(deadline):.1f}" x2="{left + plot_w}" '
           f'y2="{y(deadline):.1f}" stroke="#03c" stroke-dasharray="6 4"/>',
           f'<text x="{left + plot_w - 120}" y="{y(deadline) - 4:.1f}" fill="#03c">deadline '
           f'{deadline:g} s</text>',
           f'<text x="{left + plot_w / 2 - 60}" y="{top + plot_h + 34}">memory (GiB)</text>',
           f'<text x="18" y="{top + plot_h / 2}" transform="rotate(-90 18 {top + plot_h / 2})">'
           'completion (s)</text>']
    for i in range(5):
        xv, yv = x_max * i / 4, y_max * i / 4
        out.append(f'<text x="{x(xv) - 10:.1f}" y="{top + plot_h + 16}">{xv:.1f}</text>')
        out.append(f'<text x="{left - 40}" y="{y(yv) + 4:.1f}">{yv:.1f}</text>')
    for i, (p, m) in enumerate(zip(points, marks(points), strict=True)):
        px, py = x(p.memory_gib), y(p.completion_s)
        color = "#080" if p.feasible else "#a00"
        if p.measured:
            out.append(f'<path d="M{px:.1f} {py - 7:.1f} L{px + 7:.1f} {py:.1f} L{px:.1f} '
                       f'{py + 7:.1f} L{px - 7:.1f} {py:.1f} Z" fill="#f90" stroke="black"/>')
        else:
            fill = color if p.feasible else "white"
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{fill}" '
                       f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{px + 7:.1f}" y="{py - 6:.1f}">{escape(m)}</text>')
        status = "ok" if p.feasible else "no"
        out.append(f'<text x="{left + plot_w + 30}" y="{top + 14 * i:.0f}" fill="{color}">'
                   f'{escape(m)} {status} {escape(p.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

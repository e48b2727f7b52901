"""Time charts with axes, drawn from the engine's bucketed history (`figures.Bucket`).

The history is one bucket per `bucket_s` of engine time in which a step ran (idle intervals
have none). `columns` lays it onto a fixed number of character columns, each covering a whole
number of buckets, so a long run is summed, not sampled; `plot` draws one series as rows of
eighth-block bars with a y scale, a time axis and knob-change marks (▲, and the column in
yellow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.text import Text

from kvdeck.runtime.stats.figures import Bucket

EIGHTHS = " ▁▂▃▄▅▆▇█"
AXIS_WIDTH = 8
"""Characters left of the plot for the y labels."""


@dataclass(frozen=True)
class Columns:
    """History laid onto character columns: `groups[i]` are the buckets of column i, which
    starts at `start + i * column_s` engine seconds."""

    groups: list[list[Bucket]]
    start: float
    column_s: float

    @property
    def marks(self) -> set[int]:
        return {i for i, g in enumerate(self.groups) if any(b.knob_change for b in g)}

    def series(self, value: Callable[[list[Bucket], float], float | None]) -> list[float | None]:
        """One value per column; `value(buckets, column_s)` (None: nothing to show there)."""
        return [value(g, self.column_s) if g else None for g in self.groups]


def columns(history: Sequence[Bucket], bucket_s: float, width: int) -> Columns:
    """Lay `history` onto at most `width` columns, ending with the newest bucket."""
    if not history:
        return Columns([], 0.0, bucket_s)
    first, last = history[0].start, history[-1].start
    span_buckets = round((last - first) / bucket_s) + 1
    per_column = max(math.ceil(span_buckets / max(width, 1)), 1)
    column_s = per_column * bucket_s
    n = math.ceil(span_buckets / per_column)
    # Align columns so the newest bucket closes the last one.
    start = last + bucket_s - n * column_s
    groups: list[list[Bucket]] = [[] for _ in range(n)]
    for b in history:
        i = min(max(int((b.start - start) / column_s + 1e-9), 0), n - 1)
        groups[i].append(b)
    return Columns(groups, start, column_s)


def nice_top(peak: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above `peak` (1 for an empty chart)."""
    if peak <= 0:
        return 1.0
    k = 10 ** math.floor(math.log10(peak))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= peak * (1 - 1e-9))


def short(x: float) -> str:
    """A y label in at most 6 characters."""
    if x >= 1e6:
        return f"{x / 1e6:.3g}M"
    if x >= 1e3:
        return f"{x / 1e3:.3g}k"
    return f"{x:.3g}"


def clock(t: float) -> str:
    """Engine time as m:ss (h:mm:ss past an hour)."""
    t = max(t, 0.0)
    h, rem = divmod(int(t), 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def plot(values: Sequence[float | None], marks: set[int], height: int, start: float,
         column_s: float, top: float | None = None, repeat: int = 1) -> list[Text]:
    """Rows of the chart: `height` bar rows with y labels, the axis with knob marks, and the
    time labels under it. Each value is drawn `repeat` characters wide (a short history
    stretched over the width). A row's label is the value at its top edge; the bottom row's
    is 0, the baseline."""
    height = max(height, 1)
    peak = max((v for v in values if v is not None), default=0.0)
    top = nice_top(peak) if top is None else top
    end = start + len(values) * column_s
    if repeat > 1:
        values = [v for v in values for _ in range(repeat)]
        marks = {i * repeat + k for i in marks for k in range(repeat)}
    middle = height // 2 - 1
    rows = []
    for r in range(height - 1, -1, -1):
        label = short(top) if r == height - 1 else "0" if r == 0 else \
            short((r + 1) / height * top) if r == middle else ""
        row = Text(f"{label:>{AXIS_WIDTH - 2}} ┤" if label else " " * (AXIS_WIDTH - 1) + "│",
                   style="dim")
        for i, v in enumerate(values):
            eighths = 0 if v is None else min(max(round(v / top * height * 8), 0), height * 8)
            cell = min(max(eighths - r * 8, 0), 8)
            row.append(EIGHTHS[cell], style="bold yellow" if i in marks else "cyan")
        rows.append(row)
    axis = Text(" " * (AXIS_WIDTH - 1) + "└", style="dim")
    for i in range(len(values)):
        axis.append("▲" if i in marks else "─", style="bold yellow" if i in marks else "dim")
    rows.append(axis)
    n = len(values)
    left, right = clock(start), clock(end)
    gap = max(n - len(left) - len(right), 1)
    rows.append(Text(" " * AXIS_WIDTH + left + " " * gap + right, style="dim"))
    return rows

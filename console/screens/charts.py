"""The charts screen (`c`): request rate, prompt and generation tokens/s, step time, KV
usage and the read bandwidth steps reached (against the peak where known) over the engine's
whole kept history (an hour of engine time), with axes and knob-change marks. Drawn from
snapshots only (`figures.history`), so live and replay draw the same charts.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Header, Static

from kvdeck.console.widgets.chart import AXIS_WIDTH, Columns, columns, plot
from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.runtime.stats.figures import Bucket
from kvdeck.runtime.views.snapshot import EngineSnapshot


def _rate(field: str):
    return lambda g, s: sum(getattr(b, field) for b in g) / s


def _step_ms(g: list[Bucket], _: float) -> float | None:
    steps = sum(b.steps for b in g)
    return sum(b.busy_s for b in g) / steps * 1e3 if steps else None


def _kv(g: list[Bucket], _: float) -> float:
    return max(b.kv_usage for b in g) * 100


def _read_gb_s(g: list[Bucket], _: float) -> float | None:
    busy = sum(b.busy_s for b in g)
    return sum(b.bytes_read for b in g) / busy / 1e9 if busy else None


CHARTS = (
    ("requests/s arriving", _rate("arrivals"), None),
    ("prompt tokens/s computed", _rate("prefill_tokens"), None),
    ("generation tokens/s", _rate("generated_tokens"), None),
    ("step time, ms (mean)", _step_ms, None),
    ("KV usage, % of the pool held by requests (peak)", _kv, 100.0),
    ("read GB/s while stepping", _read_gb_s, None),
)
"""Title, value per column, fixed top (None: scaled to the data). The read-bandwidth chart's
top is the machine's peak where the roofline knows it, so its height is the MBU."""


def latest(values: list[float | None]) -> str:
    v = next((x for x in reversed(values) if x is not None), None)
    return "—" if v is None else f"{v:,.1f}"


class ChartsScreen(Screen):
    """Six charts over the history of the latest snapshot; the app feeds `show(snapshot)`."""

    DEFAULT_CSS = "ChartsScreen #charts { height: 1fr; padding: 0 1; }"
    BINDINGS = [Binding("escape,c", "app.pop_screen", "Back", id="charts.back")]

    def __init__(self) -> None:
        super().__init__()
        self._snap: EngineSnapshot | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("No history yet: the charts fill as the engine steps.", id="charts")
        yield KeysFooter()

    def on_mount(self) -> None:
        if self.app.latest is not None:
            self.show(self.app.latest)

    def on_resize(self, _: events.Resize) -> None:
        if self._snap is not None:
            self.show(self._snap)

    def show(self, snap: EngineSnapshot) -> None:
        self._snap = snap
        figures = snap.figures
        if figures is None or not figures.history:
            return
        pane = self.query_one("#charts", Static)
        width = max(pane.size.width - AXIS_WIDTH - 3, 10)
        cols: Columns = columns(figures.history, figures.bucket_s, width)
        # Each chart: a title line, its bar rows, the axis and the time labels.
        height = max((pane.size.height or 30) // len(CHARTS) - 3, 1)
        parts: list[Text] = []
        r = snap.roofline
        peak_gb_s = r.bytes_read / r.memory_s / 1e9 if r is not None and r.memory_s else None
        for title, value, top in CHARTS:
            values = cols.series(value)
            if value is _read_gb_s:
                if not any(values):
                    continue  # an executor that reports no bytes read
                if peak_gb_s:
                    top = peak_gb_s
                    title = f"{title} (top: peak {peak_gb_s:,.0f}, height = MBU)"
            parts.append(Text.assemble((title, "bold"), f"  now {latest(values)}",
                                       (f"  · a bar sums {cols.column_s:g} s", "dim")))
            parts.extend(plot(values, cols.marks, height, cols.start, cols.column_s, top,
                              repeat=max(width // max(len(values), 1), 1)))
        span = figures.history[-1].start + figures.bucket_s - figures.history[0].start
        self.sub_title = (f"{span:,.0f} s of engine time · ▲ knob change · "
                          "Esc or c goes back")
        pane.update(Group(*parts))

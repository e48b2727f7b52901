"""Metrics panel: latency percentiles, throughput, KV usage and prefix hit rate over time
(sparklines, with knob changes marked), and resident requests."""

from __future__ import annotations

from collections import deque

from rich.console import Group
from rich.table import Table
from rich.text import Text

from console.widgets.base import SnapshotPanel
from runtime.snapshot import EngineSnapshot

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], marks: set[int], width: int, top: float = 1.0) -> Text:
    """Bars scaled to `top`; positions in `marks` are drawn as a knob-change marker."""
    t = Text()
    for i, v in enumerate(values[-width:]):
        if i + max(len(values) - width, 0) in marks:
            t.append("┃", style="bold yellow")
        else:
            level = min(int(v / top * (len(BARS) - 1) + 0.5), len(BARS) - 1) if top else 0
            t.append(BARS[max(level, 0)], style="cyan")
    return t


def ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.0f}"


class MetricsPanel(SnapshotPanel):
    """Rolling latency, throughput, KV and cache history."""

    DEFAULT_CSS = "MetricsPanel { height: 1fr; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Metrics"
    HISTORY = 240

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.usage: deque[float] = deque(maxlen=self.HISTORY)
        self.hits: deque[float] = deque(maxlen=self.HISTORY)
        self.marks: deque[int] = deque(maxlen=32)
        self.samples = 0
        self._finished: deque[tuple[float, int]] = deque(maxlen=self.HISTORY)
        self.throughput = 0.0
        """Finished requests per second of engine time over the recent snapshot window."""

    def mark_knob_change(self) -> None:
        self.marks.append(self.samples)

    def show(self, snap: EngineSnapshot) -> None:
        """Record the snapshot in the history, then draw."""
        self.usage.append(snap.kv.usage)
        self.hits.append(snap.kv.hit_rate)
        self.samples += 1
        self._finished.append((snap.time, snap.num_finished))
        t0, n0 = self._finished[0]
        if snap.time > t0:
            self.throughput = (snap.num_finished - n0) / (snap.time - t0)
        super().show(snap)

    def draw(self, snap: EngineSnapshot) -> None:
        r = snap.recent
        table = Table(box=None, expand=True, pad_edge=False)
        for col in ("ms", "p50", "p99"):
            table.add_column(col, justify="right" if col != "ms" else "left")
        for name in ("ttft", "itl", "tpot", "e2e"):
            d = r[name]
            table.add_row(name.upper(), ms(d.p50), ms(d.p99))
        width = max(self.size.width - 14, 10)
        offset = self.samples - len(self.usage)
        marks = {m - offset for m in self.marks}
        lines = [
            table,
            Text(f"throughput {self.throughput:.2f} req/s · goodput "
                 f"{self.throughput * (r.get('good_fraction') or 0):.2f} req/s"
                 + (f" ({r['good_fraction']:.0%} met deadlines)"
                    if r.get("good_fraction") is not None else "")),
            Text(f"resident {len(snap.running) + len(snap.waiting)} now · mean "
                 + (f"{r['mean_resident']:.1f}" if r.get("mean_resident") is not None
                    else "—") + " vs λ·T "
                 + (f"{r['littles_prediction']:.1f}" if r.get("littles_prediction")
                    is not None else "—") + f" · t = {snap.time:,.1f} s"),
            Text("KV used  ").append_text(sparkline(list(self.usage), marks, width))
            .append(f" {snap.kv.usage:.0%}"),
            Text("hit rate ").append_text(sparkline(list(self.hits), marks, width))
            .append(f" {snap.kv.hit_rate:.0%}"),
        ]
        self.update(Group(*lines))

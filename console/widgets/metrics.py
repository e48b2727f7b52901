"""Metrics panel: latency percentiles, throughput and goodput, energy, KV usage and prefix
hit rate over time (sparklines, with knob changes marked), resident requests, and answer checks
passed where requests carried them.

Every number and chart comes from the snapshot: the latency figures and the time-bucketed
history are kept by the engine (`runtime/stats/figures.py`), so the live console and replay of
the same run draw the same charts."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdeck.console.widgets.base import SnapshotPanel
from kvdeck.runtime.views.snapshot import EngineSnapshot

BARS = "▁▂▃▄▅▆▇█"
RATE_WINDOW = 10
"""History buckets (seconds of engine time) the throughput figure averages over."""


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

    def draw(self, snap: EngineSnapshot) -> None:
        r = snap.recent
        table = Table(box=None, expand=True, pad_edge=False)
        for col in ("ms", "p50", "p99"):
            table.add_column(col, justify="right" if col != "ms" else "left")
        for name in ("ttft", "itl", "tpot", "e2e"):
            d = r[name]
            table.add_row(name.upper(), ms(d.p50), ms(d.p99))
        history = list(snap.figures.history) if snap.figures is not None else []
        bucket_s = snap.figures.bucket_s if snap.figures is not None else 1.0
        window = history[-RATE_WINDOW:]
        # Engine seconds the window covers, idle intervals (no bucket) included.
        span = window[-1].start + bucket_s - window[0].start if window else 0.0

        def rate(field: str) -> float:
            return sum(getattr(b, field) for b in window) / span if span else 0.0
        throughput = rate("finished")
        narrow = self.size.width < 40  # 80 columns: shorter lines, nothing wraps
        width = max(self.size.width - 14, 4)  # the label (9) and the value (5) beside it
        marks = {i for i, b in enumerate(history) if b.knob_change}
        good = r.get("good_fraction")
        line = f"done {throughput:.2f}/s" if narrow else f"throughput {throughput:.2f} req/s"
        deadlines, checks = r.get("has_deadlines"), r.get("has_checks")
        if (deadlines or checks) and good is not None:
            what = "met deadlines" if not checks else \
                "on time and correct" if deadlines else "correct"
            line += f" · good {good:.0%}" if narrow else \
                f" · goodput {throughput * good:.2f} req/s ({good:.0%} {what})"
        rates = (f"in {rate('arrivals'):.1f}/s · {rate('generated_tokens'):,.0f} tok/s"
                 if narrow else
                 f"in {rate('arrivals'):.2f} req/s · prompt {rate('prefill_tokens'):,.0f} · "
                 f"gen {rate('generated_tokens'):,.0f} tok/s (c: charts)")
        mean = f"{r['mean_resident']:.1f}" if r.get("mean_resident") is not None else "—"
        predicted = f"{r['littles_prediction']:.1f}" if r.get("littles_prediction") \
            is not None else "—"
        resident = len(snap.running) + len(snap.waiting)
        lines = [
            table,
            Text(line),
            *self._check_lines(snap, narrow),
            Text(rates),
            Text(f"resident {resident} now\nmean {mean} · λT {predicted}" if narrow else
                 f"resident {resident} now · mean {mean} vs λ·T {predicted} · "
                 f"t = {snap.time:,.1f} s"),
            *self._model_lines(r, narrow, self.size.width < 28),
            *self._waste_lines(snap, narrow),
            *self._energy_lines(snap, narrow),
            Text("KV used  ").append_text(sparkline([b.kv_usage for b in history], marks,
                                                    width))
            .append(f" {snap.kv.usage:.0%}"),
            Text("cached   ").append_text(sparkline([b.kv_cached for b in history], marks,
                                                    width))
            .append(f" {snap.kv.cached_fraction:.0%}"),
            Text("hit rate ").append_text(sparkline([b.hit_rate for b in history], marks,
                                                    width))
            .append(f" {snap.kv.hit_rate:.0%}"),
        ]
        if snap.lag_s > 0.5:
            lines.append(Text(f"the simulation is {snap.lag_s:,.1f} s behind its pace",
                              style="bold yellow"))
        self.update(Group(*lines))

    @staticmethod
    def _energy_lines(snap: EngineSnapshot, narrow: bool) -> list[Text]:
        """Joules so far and per good result, and where they come from (measured counters,
        or the sim's model); where nothing is readable, the wide layout says why."""
        e = snap.energy
        if e is None or (e["joules"] is None and narrow):
            return []
        if e["joules"] is None:
            return [Text(f"energy {e['source']}", style="dim")]
        j, per = e["joules"], e["joules_per_good"]
        total = f"{j / 1e3:,.1f} kJ" if j >= 1e4 else f"{j:,.0f} J"
        good = "—" if per is None else f"{per:,.1f} J"
        if narrow:  # one short line: per good result once there is one, else the total
            return [Text(f"energy {good}/good" if per is not None else f"energy {total}")]
        return [Text(f"energy {total} · {good} per good result ", style="").append(
            f"({e['source']})", style="dim")]

    @staticmethod
    def _check_lines(snap: EngineSnapshot, narrow: bool) -> list[Text]:
        """Answers that passed their check, of those checked (none: no line)."""
        f = snap.figures
        if f is None or not f.num_checked:
            return []
        n, passed = f.num_checked, f.num_checked - f.num_check_failures
        return [Text(f"correct {passed:,}/{n:,}" if narrow else
                     f"answers correct {passed:,} of {n:,} checked "
                     f"({f.num_check_failures:,} failed)",
                     style="yellow" if f.num_check_failures else "")]

    @staticmethod
    def _waste_lines(snap: EngineSnapshot, narrow: bool) -> list[Text]:
        """Computed against useful tokens, and what the rest was wasted on (no line while
        nothing was wasted: the panel is short)."""
        w = snap.figures.waste if snap.figures is not None else None
        causes = {c: n for c, n in w.wasted.items() if n} if w is not None else {}
        if not causes:
            return []
        if narrow:  # 20 columns: the useful share and the largest cause
            short = {"preemption": "preempt", "format switch": "switch",
                     "offload switch": "offload", "lost KV": "lost",
                     "rejected drafts": "drafts", "padding": "padding"}
            text = Text(f"useful {w.useful / w.computed:.0%}")
            top = max(causes, key=causes.get)
            text.append(f" ({short.get(top, top)})", style="yellow")
            return [text]
        text = Text(f"computed {w.computed:,} tok · useful {w.useful / w.computed:.1%}")
        for name, n in causes.items():
            text.append(f" · {name} {n:,}", style="yellow")
        return [text]

    @staticmethod
    def _model_lines(r: dict, narrow: bool, tiny: bool) -> list[Text]:
        """How honest the timing model is: predicted against measured step time, and the
        admission forecast's finish-time error."""
        lines = []
        model = r.get("step_model")
        if model is not None:
            p, m, err = model
            lines.append(Text(f"step model ±{err:.0%}" if tiny else
                              f"step {p * 1e3:,.1f} pred / {m * 1e3:,.1f} ms ±{err:.0%}"
                              if narrow else
                              f"step model: predicted {p * 1e3:,.1f} vs measured "
                              f"{m * 1e3:,.1f} ms (mean |error| {err:.1%})",
                              style="yellow" if err > 0.15 else ""))
        forecast = r.get("forecast_error")
        if forecast is not None:
            err, n = forecast
            lines.append(Text(f"finish forecast ±{err:.1%}" if narrow else
                              f"finish forecast: mean |error| {err:.1%} over {n} requests"))
        return lines

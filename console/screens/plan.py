"""The plan screen (`P`): the planner's memory-vs-completion plane for the workload the
engine is seeing, every scheme a point, the engine's own measured point (`@`) beside them,
recomputed at most once a second as requests and knobs change (`runtime/planning/live_plan.py`)."""

from __future__ import annotations

import math
import time

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Header, Static

from kvdeck.console.plane import Point, marks, render_text
from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.planning.live_plan import (
    current_scheme,
    live_plan,
    live_profiles,
    live_workload,
)
from kvdeck.runtime.views.snapshot import EngineSnapshot

GIB = 2**30
REFRESH_S = 1.0


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


class PlanScreen(Screen):
    """The plane for the live workload; the app feeds `show(snapshot)`."""

    DEFAULT_CSS = "PlanScreen #plan { height: 1fr; padding: 0 1; }"
    BINDINGS = [Binding("escape,P", "app.pop_screen", "Back", id="plan.back")]

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine
        self.profiles = None
        self._shown_at = 0.0
        self._snap: EngineSnapshot | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Reading the card and model profiles…", id="plan")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.sub_title = "the planner on the live workload · Esc or P goes back"
        self.run_worker(self._load_profiles, thread=True, exclusive=True)

    def _load_profiles(self) -> None:
        # A real executor measures this machine (a few seconds): off the UI thread.
        profiles = live_profiles(self.engine)
        self.app.call_from_thread(self._profiles_ready, profiles)

    def _profiles_ready(self, profiles) -> None:
        self.profiles = profiles
        snap = self._snap or self.app.latest
        if snap is not None:
            self.show(snap, force=True)

    def show(self, snap: EngineSnapshot, force: bool = False) -> None:
        self._snap = snap
        if self.profiles is None or (not force and time.monotonic() - self._shown_at
                                     < REFRESH_S):
            return
        self._shown_at = time.monotonic()
        pane = self.query_one("#plan", Static)
        live = live_workload(snap)
        if live is None:
            pane.update("No requests yet: the plan needs a workload to size.")
            return
        hw, model = self.profiles
        try:
            planner, plan = live_plan(hw, model, snap, live)
        except KvdeckError as e:  # e.g. requests longer than the model's context
            pane.update(f"No plan for this workload: {e}")
            return
        w = live.workload
        current = current_scheme(snap, planner)
        points = [Point(r.scheme.name, r.memory_bytes / GIB, r.completion_s, r.feasible)
                  for r in plan.results]
        measured = live.measured_e2e_s
        if measured is not None:
            points.append(Point("measured", live.measured_memory_bytes / GIB, measured,
                                measured <= w.deadline_s, measured=True))
        deadline = f"deadline {w.deadline_s:g} s" + (" (assumed: no request carries one)"
                                                     if live.deadline_assumed else "")
        head = Text.assemble(
            (f"{model.name} on {hw.description}", "bold"),
            f" · timing {planner.timing} · KV pool {size(planner.budget)}\n",
            f"workload seen: {w.prompt_tokens} in / {w.output_tokens} out, "
            f"{w.shared_prefix_tokens} cached, {w.rate_per_s:.2f} req/s; {deadline}")
        width = max(self.size.width - 20, 30)
        plane = Text("\n".join(render_text(points, planner.budget / GIB, w.deadline_s,
                                           width=width, height=14)))
        table = Table(box=None, pad_edge=False)
        for col in ("", "scheme", "memory", "TTFT s", "done s", "verdict"):
            table.add_column(col, justify="right" if col in ("memory", "TTFT s", "done s")
                             else "left")
        for r, m in zip(plan.results, marks(points), strict=False):
            now = r.scheme == current
            style = "bold" if now else ""
            verdict = ("[green]feasible[/]" if r.feasible else f"[red]{r.verdict()}[/]") \
                + (" [bold](chosen)[/]" if r is plan.choice else "")
            done = "∞" if math.isinf(r.completion_s) else f"{r.completion_s:.2f}"
            name = Text.assemble(("▶ " if now else "  ", "bold cyan"), (r.scheme.name, style))
            table.add_row(m, name, size(r.memory_bytes),
                          f"{r.ttft_s:.2f}", done, verdict)
        tail = Text("▶ the scheme the knobs make now.  "
                    f"@ measured: {size(live.measured_memory_bytes)} held by requests "
                    f"(peak, last minute), mean E2E {measured:.2f} s" if measured is not None
                    else "@ measured: no finished request yet")
        pane.update(Group(head, plane, tail, table))

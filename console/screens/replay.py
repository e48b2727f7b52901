"""`kvdeck replay RUN`: the console's panels fed from a recorded iteration trace — no model,
no engine — with play/pause, speed and a scrubber.

Moving forward applies records to a `TraceState`; moving back restores the nearest
checkpoint (one every `CHECKPOINT` records, taken on the way forward, in the same form as the
checkpoint a mid-run recording starts with) and re-applies from there, so scrubbing a long
run stays quick.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Header

from kvdeck.console.base_app import ConsoleApp
from kvdeck.console.layout import SNAPSHOT_PANELS, compose_panels
from kvdeck.console.screens.charts import ChartsScreen
from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.console.widgets.knobs import KnobsPanel
from kvdeck.console.widgets.scrubber import Scrubber
from kvdeck.runtime.errors import RunFormatError
from kvdeck.runtime.runs.replay import TraceState, load_replay
from kvdeck.runtime.views.snapshot import EngineSnapshot

CHECKPOINT = 200
SPEEDS = (0.25, 0.5, 1, 2, 4, 8, 16, 32)


class ReplayApp(ConsoleApp):
    """Playback of a run directory."""

    TITLE = "kvdeck replay"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="replay.quit"),
        Binding("space", "toggle_play", "Play", id="replay.play", priority=True),
        Binding("right", "move(1)", "+1", id="replay.next", priority=True),
        Binding("left", "move(-1)", "-1", id="replay.prev", priority=True),
        Binding("pagedown", "move(50)", "+50", id="replay.next50", show=False, priority=True),
        Binding("pageup", "move(-50)", "-50", id="replay.prev50", show=False, priority=True),
        Binding("home", "seek_start", "Start", id="replay.start", show=False, priority=True),
        Binding("end", "seek_end", "End", id="replay.end", show=False, priority=True),
        Binding("right_square_bracket", "speed(1)", "Faster", id="replay.faster"),
        Binding("left_square_bracket", "speed(-1)", "Slower", id="replay.slower"),
        Binding("n", "select_next", "Select", id="replay.select"),
        Binding("c", "charts", "Charts", id="replay.charts"),
        Binding("t", "next_theme", "Theme", id="replay.theme"),
        Binding("f1", "help", "Help", id="replay.help"),
    ]

    def __init__(self, run_dir: str | Path):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.replay = load_replay(self.run_dir)
        self.header = self.replay.header
        self.records = self.replay.steps
        self.marks = {i for i, r in enumerate(self.records) if r.knobs}
        self.state = self.replay.initial_state()
        self.applied = 0
        """Records applied to `state` (the shown one is `applied - 1`)."""
        self.checkpoints: dict[int, tuple] = {0: self._save()}
        self.playing = False
        self.speed_index = SPEEDS.index(1)
        self.snapshot: EngineSnapshot | None = None
        self.problem: str | None = None
        """Why the replay stopped, when a record could not be applied."""
        self.sub_title = f"{self.run_dir.name} · {self.header.get('model', '?')}"

    def _save(self) -> tuple:
        return self.state.checkpoint(), self.state.last_batch, self.state.last_ran

    def _load(self, saved: tuple) -> TraceState:
        checkpoint, batch, ran = saved
        state = TraceState(self.header)
        state.restore(checkpoint)
        state.last_batch, state.last_ran = batch, ran
        return state

    def compose(self) -> ComposeResult:
        yield Header()
        yield Scrubber(len(self.records), self.marks, id="scrubber")
        yield from compose_panels()
        yield KeysFooter()

    def on_mount(self) -> None:
        self.setup_themes()
        self.seek(0)
        self.every(0.1, self._tick)

    # -- position ---------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return self.applied - 1

    def seek(self, position: int) -> None:
        """Show the state after record `position` (clamped to the run)."""
        if not self.records:  # only a checkpoint: its state is all there is to show
            self.show()
            return
        position = max(0, min(position, len(self.records) - 1))
        target = position + 1
        if target < self.applied:
            base = max(k for k in self.checkpoints if k <= target)
            self.state = self._load(self.checkpoints[base])
            self.applied = base
        while self.applied < target:
            try:
                self.state.apply(self.records[self.applied])
            except RunFormatError as e:
                self.problem = str(e)
                self.exit(return_code=2)
                return
            self.applied += 1
            if self.applied % CHECKPOINT == 0 and self.applied not in self.checkpoints:
                self.checkpoints[self.applied] = self._save()
        self.show()

    def show(self) -> None:
        snap = self.state.snapshot()
        self.snapshot = self.latest = snap
        main = self.screen_stack[0]  # the panels, whatever screen is on top of them
        for panel in SNAPSHOT_PANELS:
            main.query_one(panel).show(snap)
        if isinstance(self.screen, ChartsScreen):
            self.screen.show(snap)
        main.query_one(KnobsPanel).show_values(snap.knobs, {})
        main.query_one(Scrubber).draw(self.position, self.state.step, self.state.time,
                                      SPEEDS[self.speed_index], self.playing)

    def _tick(self) -> None:
        if not self.playing:
            return
        # Speed 1 plays 10 records a second; fractions advance every few ticks.
        self._carry = getattr(self, "_carry", 0.0) + SPEEDS[self.speed_index]
        step, self._carry = int(self._carry), self._carry - int(self._carry)
        if step:
            if self.position + step >= len(self.records) - 1:
                self.playing = False
            self.seek(self.position + step)

    # -- actions ----------------------------------------------------------------------------

    def on_scrubber_seek(self, event: Scrubber.Seek) -> None:
        self.seek(event.position)

    def action_charts(self) -> None:
        """The charts screen over the history up to the shown step."""
        if not isinstance(self.screen, ChartsScreen):
            self.push_screen(ChartsScreen())

    def action_toggle_play(self) -> None:
        self.playing = not self.playing
        self.show()

    def action_move(self, delta: int) -> None:
        self.seek(self.position + delta)

    def action_seek_start(self) -> None:
        self.seek(0)

    def action_seek_end(self) -> None:
        self.seek(len(self.records) - 1)

    def action_speed(self, direction: int) -> None:
        self.speed_index = max(0, min(self.speed_index + direction, len(SPEEDS) - 1))
        self.show()

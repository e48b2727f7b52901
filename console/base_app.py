"""What the live console, replay and the fleet share: stylesheet, breakpoints, themes, help,
timers, and cycling the highlighted request."""

from __future__ import annotations

from collections.abc import Callable

from textual.app import App

from kvdeck.console.screens.help import HelpScreen
from kvdeck.console.themes import load_themes
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.console.widgets.prefix_tree import PrefixTreePanel
from kvdeck.runtime.resources import themes_dir
from kvdeck.runtime.views.snapshot import EngineSnapshot


class ConsoleApp(App):
    """Base of `KvdeckApp`, `ReplayApp` and `FleetApp`; the first two keep `latest` current."""

    CSS_PATH = str(themes_dir().joinpath("kvdeck.tcss"))
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    latest: EngineSnapshot | None = None

    def setup_themes(self) -> None:
        for theme in load_themes():
            self.register_theme(theme)
        self.theme = "kvdeck-dark"

    def every(self, seconds: float, callback: Callable[[], object]) -> None:
        """Call `callback` every `seconds` while the app runs. An app's timer ticks outside
        its message queue, so it can fire while the app closes, after its screens' widgets
        are gone (a refresh that queries them raised NoMatches): those ticks are skipped."""
        def tick() -> None:
            if self.is_running:
                callback()
        self.set_interval(seconds, tick)

    def action_next_theme(self) -> None:
        names = [t.name for t in load_themes()]
        self.theme = names[(names.index(self.theme) + 1) % len(names)
                           if self.theme in names else 0]

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_select_next(self) -> None:
        """Highlight the next running request's blocks and prefix path."""
        kv = self.query_one(KVMapPanel)
        ids = [v.request_id for v in self.latest.running] if self.latest is not None else []
        kv.selected = ids[(ids.index(kv.selected) + 1) % len(ids) if kv.selected in ids
                          else 0] if ids else None
        self.query_one(PrefixTreePanel).selected = kv.selected
        if self.latest is not None:
            kv.show(self.latest)
            self.query_one(PrefixTreePanel).show(self.latest)

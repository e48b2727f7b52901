"""Base for panels drawn from a snapshot: they remember it and redraw when resized, since
how much fits (grid cells, table rows) depends on the panel's size."""

from __future__ import annotations

from textual import events
from textual.widgets import Static

from kvdeck.runtime.views.snapshot import EngineSnapshot


class SnapshotPanel(Static):
    """Subclasses implement `draw(snapshot)`; callers use `show(snapshot)`."""

    _snapshot: EngineSnapshot | None = None

    def show(self, snap: EngineSnapshot) -> None:
        self._snapshot = snap
        self.draw(snap)

    def draw(self, snap: EngineSnapshot) -> None:
        raise NotImplementedError  # abstract: every panel draws its own view

    def on_resize(self, _: events.Resize) -> None:
        if self._snapshot is not None:
            self.draw(self._snapshot)

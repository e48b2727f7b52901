"""Speculation panel: draft acceptance per position and tokens per round. Speculative
decoding is not configured in this runtime yet; the panel says so plainly."""

from __future__ import annotations

from rich.text import Text

from console.widgets.base import SnapshotPanel
from runtime.snapshot import EngineSnapshot


class SpeculationPanel(SnapshotPanel):
    DEFAULT_CSS = "SpeculationPanel { height: auto; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Speculation"

    def draw(self, snap: EngineSnapshot) -> None:
        self.update(Text("Speculative decoding is off: no draft model is configured.",
                         style="dim"))

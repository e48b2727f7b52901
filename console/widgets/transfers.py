"""Transfers panel: device↔host traffic per step. Nothing in the runtime moves KV or weights
between tiers yet, and the panel says so plainly instead of drawing zeros."""

from __future__ import annotations

from rich.text import Text

from console.widgets.base import SnapshotPanel
from runtime.snapshot import EngineSnapshot


class TransfersPanel(SnapshotPanel):
    DEFAULT_CSS = "TransfersPanel { height: auto; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Transfers"

    def draw(self, snap: EngineSnapshot) -> None:
        self.update(Text("Nothing is configured to move between device and host: no host "
                         "KV tier, no swap preemption, no weight offload.", style="dim"))

"""The panel layout shared by the live console and replay."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical

from kvdeck.console.widgets.knobs import KnobsPanel
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.console.widgets.metrics import MetricsPanel
from kvdeck.console.widgets.prefix_tree import PrefixTreePanel
from kvdeck.console.widgets.queue import QueuePanel
from kvdeck.console.widgets.routing import RoutingPanel
from kvdeck.console.widgets.speculation import SpeculationPanel
from kvdeck.console.widgets.transfers import TransfersPanel

SNAPSHOT_PANELS = (QueuePanel, KVMapPanel, PrefixTreePanel, MetricsPanel, TransfersPanel,
                   SpeculationPanel)


def compose_panels(routing: bool = False) -> ComposeResult:
    """The panels; `routing`: with the cascade's routing panel (`kvdeck serve --cascade
    --console`)."""
    with Horizontal():
        with Vertical(id="left"):
            yield QueuePanel(id="queue")
            yield KnobsPanel(id="knobs")
        with Vertical(id="middle"):
            yield KVMapPanel(id="kvmap")
            yield PrefixTreePanel(id="prefix")
        with Vertical(id="right"):
            yield MetricsPanel(id="metrics")
            yield TransfersPanel(id="transfers")
            yield SpeculationPanel(id="speculation")
            if routing:
                yield RoutingPanel(id="routing")

"""The footer every kvdeck screen uses: on a terminal under 120 columns it packs its keys
tightly and leaves out the command-palette hint (ctrl+p still works; F1 lists every key), so
the keys an operator needs most (first in each screen's bindings) stay visible at 80×24."""

from __future__ import annotations

from textual import events
from textual.widgets import Footer

WIDE = 120


class KeysFooter(Footer):
    def on_mount(self) -> None:
        self._fit(self.app.size.width)

    def on_resize(self, event: events.Resize) -> None:
        self._fit(self.app.size.width)

    def _fit(self, width: int) -> None:
        self.compact = width < WIDE
        self.show_command_palette = width >= WIDE

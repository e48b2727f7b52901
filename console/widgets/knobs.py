"""Knobs panel: every engine knob and the traffic settings with their current values; Enter
opens an editor. Values are parsed by the knob's declared type and validated by the engine —
an invalid value is reported and changes nothing."""

from __future__ import annotations

import dataclasses

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from runtime.config import Knobs
from runtime.errors import ConfigError

TRAFFIC_KNOBS = ("traffic_rate_per_s", "traffic_long_fraction")
KNOB_TYPES = {f.name: f.type for f in dataclasses.fields(Knobs)}


def parse_knob(name: str, text: str) -> object:
    """Turn the text typed for knob `name` into a value of its type (ConfigError if not)."""
    text = text.strip()
    kind = "float" if name in TRAFFIC_KNOBS else KNOB_TYPES.get(name)
    if kind is None:
        raise ConfigError(f"Unknown knob {name!r}.")
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        what = "an integer" if kind == "int" else "a number"
        raise ConfigError(f"{name} must be {what}, got {text!r}.") from None
    if kind == "bool":
        if text.lower() in ("true", "on", "yes", "1"):
            return True
        if text.lower() in ("false", "off", "no", "0"):
            return False
        raise ConfigError(f"{name} must be true or false, got {text!r}.")
    return text


class KnobEditor(ModalScreen[str | None]):
    """Asks for a new value of one knob."""

    DEFAULT_CSS = """
    KnobEditor { align: center middle; }
    KnobEditor > Vertical { width: 60; height: auto; border: thick $accent;
                            background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="knob.cancel")]

    def __init__(self, name: str, value: object) -> None:
        super().__init__()
        self.knob = name
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"New value for [b]{self.knob}[/] (now {self.value!r}); Enter applies "
                        "at the next iteration, Esc cancels.")
            yield Input(str(self.value).lower() if isinstance(self.value, bool)
                        else str(self.value), id="knob-value")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class KnobsPanel(DataTable):
    """Knob table; the app owns applying a change."""

    DEFAULT_CSS = "KnobsPanel { height: 1fr; border: round $primary; }"
    BORDER_TITLE = "Knobs (Enter to edit)"

    def on_mount(self) -> None:
        self.cursor_type = "row"
        _, self._value_col = self.add_columns("knob", "value")
        self._shown: dict[str, str] = {}

    def show_values(self, knobs: Knobs, traffic: dict[str, float]) -> None:
        for name, value in {**dataclasses.asdict(knobs), **traffic}.items():
            text = str(value)
            if name not in self._shown:
                self.add_row(name, text, key=name)
            elif self._shown[name] != text:
                self.update_cell(name, self._value_col, text)
            self._shown[name] = text

    def current(self) -> tuple[str, str] | None:
        if not self.rows:
            return None
        row = self.get_row_at(self.cursor_row)
        return row[0], row[1]

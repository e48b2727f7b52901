"""Knobs panel: every engine knob and the traffic settings with their current values; Enter
opens an editor — a list of the allowed values for a choice or a switch, a text field for a
number. A change is marked pending (`old → new`) until the engine applies it at its next
iteration. Values are parsed by the knob's declared type and validated by the engine — an
invalid value is reported and changes nothing."""

from __future__ import annotations

import dataclasses

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label, OptionList

from kvdeck.console.model_report import human_bytes
from kvdeck.runtime.core.config import KNOB_CHOICES, Knobs
from kvdeck.runtime.core.switch import Switch
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import WeightsView

TRAFFIC_KNOBS = ("traffic_rate_per_s", "traffic_long_fraction")
KNOB_TYPES = {f.name: f.type for f in dataclasses.fields(Knobs)}
CHOICES: dict[str, tuple[str, ...]] = {
    **KNOB_CHOICES,
    "enable_prefix_caching": ("true", "false"), "admission_control": ("true", "false"),
    "prefix_wait": ("true", "false"),
    "demote_prefixes": ("true", "false"), "offload_buffers": ("1", "2"),
}
"""Knobs whose values are a fixed list: the editor offers them instead of a text field."""
HINTS = {"weight_format": "dense, fp32, bf16, fp16, int8, int4, auto or measured — for all "
                          "groups, or per group like attn=int8,ffn=int4,head=bf16",
         "offload_layers": "FFN weights of the last N layers live on the host, prefetched "
                           "before each runs; the memory freed goes to the KV pool",
         "preemption": "swap and auto need a host KV tier (--host-kv-memory-gib)",
         "demote_prefixes": "with a host KV tier, evicted prefix blocks are copied there "
                            "instead of dropped; false drops the ones there now"}
"""What a typed knob accepts, when a number is not the answer."""


def shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
    """Asks for a new value of one knob: a choice from a list, or a number typed."""

    DEFAULT_CSS = """
    KnobEditor { align: center middle; }
    KnobEditor > Vertical { width: 70; max-width: 95%; height: auto; border: thick $accent;
                            background: $surface; padding: 1 2; }
    KnobEditor Label { width: 100%; }
    KnobEditor OptionList { height: auto; max-height: 10; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="knob.cancel")]

    def __init__(self, name: str, value: str, choices: tuple[str, ...] | None = None) -> None:
        """`choices`: the allowed values when they depend on the engine (KV formats)."""
        super().__init__()
        self.knob = name
        self.value = value
        self.choices = choices or CHOICES.get(name)

    def compose(self) -> ComposeResult:
        choices = self.choices
        with Vertical():
            how = "choose a value" if choices else "type a value"
            if self.knob in HINTS:
                how += f" ({HINTS[self.knob]})"
            yield Label(f"[b]{self.knob}[/] is {self.value}: {how}; Enter applies it at the "
                        "next iteration, Esc cancels.")
            if choices:
                options = OptionList(*choices, id="knob-choices")
                if self.value in choices:
                    options.highlighted = choices.index(self.value)
                yield options
            else:
                yield Input(self.value, id="knob-value")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(str(event.option.prompt))

    def action_cancel(self) -> None:
        self.dismiss(None)


class KnobsPanel(DataTable):
    """Knob table; the app owns applying a change."""

    DEFAULT_CSS = "KnobsPanel { height: 1fr; border: round $primary; }"
    BORDER_TITLE = "Knobs (Enter to edit)"

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self._knob_col, self._value_col = self.add_columns("knob", "value")
        self._shown: dict[str, object] = {}
        self.values: dict[str, str] = {}
        """Each knob's current value as text (what the editor starts from)."""

    def show_values(self, knobs: Knobs, traffic: dict[str, float],
                    pending: Knobs | None = None, weights: WeightsView | None = None,
                    switches: tuple[Switch, ...] = ()) -> None:
        """Current values; a knob submitted but not applied yet shows `old → new`; the
        weight and KV formats show their measured quality beside them when it is cached,
        and the subtitle the weights' bytes."""
        later = dataclasses.asdict(pending) if pending is not None else {}
        quality = dict(weights.quality) if weights is not None else {}
        repacks = [sw for sw in switches if sw.knob == "weight_format"]
        if repacks:  # the pause and the bytes before and after stay in sight
            sw = repacks[-1]
            self.border_title = (f"{self.BORDER_TITLE} · weights re-packed at step "
                                 f"{'?' if sw.step is None else sw.step}: "
                                 f"{sw.seconds:.2f} s, {human_bytes(sw.bytes_before)} → "
                                 f"{human_bytes(sw.bytes)}")
        if weights is not None:
            self.border_subtitle = " · ".join(
                x for x in (f"weights {human_bytes(weights.resident_bytes)}",
                            f"auto now {weights.auto}" if weights.auto else "",
                            weights.detail) if x)
        for name, value in {**dataclasses.asdict(knobs), **traffic}.items():
            text = shown(value)
            self.values[name] = text
            cell: object = text
            if name in later and later[name] != value:
                cell = Text(f"{text} → {shown(later[name])} (next step)", style="bold yellow")
            elif name in quality:
                cell = Text.assemble(text, (f"  {quality[name]}", "dim"))
            new_row = name not in self._shown
            if new_row:
                self.add_row(name, cell, key=name)
            elif self._shown[name] != str(cell):
                self.update_cell(name, self._value_col, cell)
            self._shown[name] = str(cell)
            if new_row:
                self.fit_names()

    def on_resize(self, _) -> None:
        self.fit_names()

    def fit_names(self) -> None:
        """Values always show: on a narrow panel (80 columns) the knob names are cut to the
        room the values leave (DataTable ends a cut cell with …)."""
        if not self._shown:
            return
        name_col = self.columns[self._knob_col]
        # A value and a pending change must show whole; quality figures may be cut.
        value_width = max(len(self.values.get(n, v)) if "top-1" in v else len(v)
                          for n, v in self._shown.items())
        room = self.scrollable_content_region.width - value_width - 2 * self.cell_padding - 1
        longest = max(len(n) for n in self._shown)
        name_col.auto_width = room >= longest
        name_col.width = max(min(room, longest), 6)
        self._require_update_dimensions = True
        self.refresh()

    def current(self) -> tuple[str, str] | None:
        if not self.rows:
            return None
        name = str(self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key.value)
        return name, self.values.get(name, "")

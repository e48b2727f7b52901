"""KV block map: every physical block as a cell coloured by its state; a selected request's
block table highlighted; totals and usage. With `free_window_kv` the cells are pages, and
pages of the sliding-window layers are drawn ▄ beside the full-attention layers' █."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdeck.console.model_report import human_bytes
from kvdeck.console.widgets.base import SnapshotPanel
from kvdeck.runtime.core.switch import Switch
from kvdeck.runtime.kv.eviction import evicted_ranges
from kvdeck.runtime.kv.tiers import HOST_DEMOTED, HOST_FREE, HOST_SWAPPED
from kvdeck.runtime.views.snapshot import (
    CACHED,
    CACHED_ACTIVE,
    FREE,
    PRIVATE,
    SHARED,
    EngineSnapshot,
    KVView,
)

STYLES = {FREE: ("·", "dim"), PRIVATE: ("█", "green"), SHARED: ("█", "magenta"),
          CACHED: ("▒", "blue"), CACHED_ACTIVE: ("█", "cyan")}
# When several blocks share a cell, the cell shows the "busiest" state among them.
RANK = {FREE: 0, CACHED: 1, PRIVATE: 2, CACHED_ACTIVE: 3, SHARED: 4}
HOST_STYLES = {HOST_FREE: ("·", "dim"), HOST_SWAPPED: ("▓", "red"),
               HOST_DEMOTED: ("░", "yellow")}
HOST_RANK = {HOST_FREE: 0, HOST_DEMOTED: 1, HOST_SWAPPED: 2}


def host_row(states: bytes, width: int) -> Text:
    """The host tier on one line: swapped ▓ and demoted ░ blocks, grouped to fit."""
    n = len(states)
    per_cell = max(-(-n // width), 1)
    row = Text("host ", style="bold")
    for start in range(0, n, per_cell):
        state = max(states[start:start + per_cell], key=lambda s: HOST_RANK[s])
        char, style = HOST_STYLES[state]
        row.append(char, style=style)
    return row


WINDOW_CHAR = "▄"


def window_text(kv: KVView) -> Text:
    """One line for the two layer groups: the pages each holds now, and the layout."""
    w = kv.window
    line = Text()
    line.append(f"█ full-attention {w.full_pages:,} pages", style="bold")
    line.append(" · ")
    line.append(f"{WINDOW_CHAR} window {w.window_pages:,} pages", style="bold")
    line.append(f" ({w.layout})", style="dim")
    return line


def draft_text(kv: KVView) -> str:
    """The draft model's share of the pool: every block has a twin in its pool."""
    target = kv.bytes_per_block
    share = kv.draft_bytes_per_block / (target + kv.draft_bytes_per_block)
    return (f"each block + draft twin: {human_bytes(target)} + "
            f"{human_bytes(kv.draft_bytes_per_block)} ({share:.0%} for the draft)")


def switch_text(sw: Switch) -> str:
    """One line for a format switch: what changed, the pause and what it moved."""
    step = "?" if sw.step is None else sw.step
    paused = f"paused {sw.seconds * 1e3:,.1f} ms{'' if sw.measured else ' (modelled)'}"
    preempted = f", {len(sw.preempted):,} preempted" if sw.preempted else ""
    if sw.knob == "offload_layers":
        return (f"offload {sw.old} → {sw.new} before step {step}: {paused}, weights on the "
                f"device {human_bytes(sw.bytes_before)} → {human_bytes(sw.bytes)}, pool "
                f"{sw.num_blocks:,} blocks{preempted}")
    text = f"{sw.knob} {sw.old} → {sw.new} before step {step}: {paused}"
    if sw.knob != "kv_format":
        return text + f", weights {human_bytes(sw.bytes_before)} → {human_bytes(sw.bytes)}"
    text += f", {human_bytes(sw.bytes)} converted"
    text += f", {sw.blocks:,} blocks → pool {sw.num_blocks:,}"
    if sw.dropped:
        text += f", {sw.dropped:,} cached dropped"
    return text + preempted


def _all_window(page_groups: bytes, states: bytes, start: int) -> bool:
    """Whether every page in use among `states` (pages from `start`) is a window page."""
    return all(page_groups[start + i] for i, s in enumerate(states) if s != FREE)


class KVMapPanel(SnapshotPanel):
    """The paged KV pool, block by block (or group by group when it does not fit)."""

    DEFAULT_CSS = "KVMapPanel { height: 1fr; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "KV blocks"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.selected: str | None = None
        """Request id whose blocks are highlighted."""
        self.grid = Text()
        """The last drawn cells (one character per block or group of blocks)."""

    def draw(self, snap: EngineSnapshot) -> None:
        kv = snap.kv
        width = max(self.size.width - 4, 8)
        kv_switches = [sw for sw in snap.switches if sw.knob == "kv_format"]
        switch = switch_text(kv_switches[-1]) if kv_switches else ""
        switch_rows = -(-len(switch) // width) if switch else 0
        host = snap.transfers is not None and snap.transfers.host_blocks > 0
        window = kv.window
        window_rows = -(-len(window_text(kv).plain) // width) if window else 0
        rows = max(self.size.height - 5 - switch_rows - (2 if host else 0) - window_rows
                   - (1 if kv.draft_bytes_per_block else 0) - (1 if kv.eviction else 0), 1)
        cells = width * rows
        per_cell = max(-(-kv.num_blocks // cells), 1)
        highlight: set[int] = set()
        holes: list[tuple[int, int]] = []
        for v in snap.running:
            if v.request_id == self.selected:
                highlight = set(v.block_table) - {-1}
                holes = evicted_ranges(v.block_table, kv.block_size)
        grid = Text()
        states = kv.states
        for start in range(0, kv.num_blocks, per_cell):
            group = states[start:start + per_cell]
            state = max(group, key=lambda s: RANK[s])
            char, style = STYLES[state]
            if window and state != FREE and _all_window(window.page_groups, group, start):
                char = WINDOW_CHAR
            if highlight and any(b in highlight for b in range(start, start + len(group))):
                char, style = "◆", "bold yellow"
            grid.append(char, style=style)
            if (start // per_cell + 1) % width == 0:
                grid.append("\n")
        counts = [states.count(code) for code in range(5)]  # bytes.count: C speed
        legend = Text()
        short = width < 60  # the compact legend fits one line on an 80-column terminal
        for state, name, abbrev in ((PRIVATE, "private", "prv"), (SHARED, "shared", "shr"),
                                    (CACHED_ACTIVE, "cached+used", "c+u"),
                                    (CACHED, "cached", "cch"), (FREE, "free", "free")):
            char, style = STYLES[state]
            legend.append(f"{char}{abbrev if short else ' ' + name} {counts[state]} ",
                          style=style)
        unit = " pages" if window else ""
        self.border_subtitle = (f"{kv.num_blocks}{unit} × {kv.block_size} tok · "
                                f"{kv.kv_format} · "
                                f"{kv.usage:.0%} used · {kv.num_reserved} reserved")
        what = "page" if window else "block"
        scale = f"1 cell = {per_cell} {what}s" if per_cell > 1 else f"1 cell = 1 {what}"
        sel = f" · highlighted: {self.selected}" if highlight else ""
        if holes:  # token-level eviction: what the highlighted request no longer holds
            sel += " · evicted tokens " + ", ".join(f"{a:,}–{b - 1:,}" for a, b in holes)
        if snap.weights is not None and snap.weights.adapters:  # beside the pool, not in it
            sel += f" · {snap.weights.adapters}"
        self.grid = grid
        lines = [legend, Text(scale + sel, style="dim")]
        if window:
            lines.append(window_text(kv))
        if kv.draft_bytes_per_block:
            lines.append(Text(draft_text(kv), style="dim"))
        if kv.eviction:
            lines.append(Text(kv.eviction, style="magenta"))
        if switch:
            lines.append(Text(switch, style="yellow"))
        if host:
            t = snap.transfers
            per = max(-(-t.host_blocks // max(width - 5, 1)), 1)
            legend = Text(f"host tier (1 cell = {per} block{'s' if per > 1 else ''}): ",
                          style="dim")
            for state, name in ((HOST_SWAPPED, "swapped"), (HOST_DEMOTED, "demoted"),
                                (HOST_FREE, "free")):
                char, style = HOST_STYLES[state]
                legend.append(f"{char} {name} {t.host_states.count(state)} ", style=style)
            self.update(Group(*lines, grid, legend, host_row(t.host_states, width - 5)))
            return
        self.update(Group(*lines, grid))

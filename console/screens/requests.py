"""The request table (`l`), k9s style: every request — running, waiting, preempted, and the
most recently finished — in one scrollable table, filtered by state and sorted by a column.
Enter shows a request's story (arrival, admission, prefill chunks, preemptions, first token,
finish) with its blocks and prefix path, and highlights its blocks in the KV map; `a` aborts
it; `+`/`-` change its priority (lower runs first under the priority policy).

Like every panel it draws only snapshots; abort, priority and the request to watch go to the
engine's inbox.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Header, Static

from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.runtime.views.snapshot import EngineSnapshot, RequestView

FILTERS = ("all", "running", "waiting", "finished")
COLUMNS = ("id", "state", "prompt", "out", "cached", "waited s", "prio", "preempt", "acc s",
           "r_P tok/s", "r_D /s")
"""`acc s`: accelerator seconds the request occupied (each step's time shared among its
rows by tokens); `r_P`: its prefill tokens per such second; `r_D`: its decode calls per
such second (the chapter's `t_GPU = L/r_P + (G − 1)/r_D`)."""
SORTS = ("state", "arrival", "prompt", "out", "prio")
STATE_ORDER = {"running": 0, "preempted": 1, "swapped": 1, "waiting": 2}
"""Sorting by state puts the live requests first, finished ones last."""
LIVE = ("running", "waiting", "preempted", "swapped")
"""States of a request still in the engine (the rest are final)."""
STATE_STYLE = {"running": "green", "waiting": "yellow", "preempted": "red", "swapped": "magenta",
               "finished_stopped": "dim", "finished_length": "dim", "aborted": "red",
               "rejected": "red"}


def rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def occupancy(v: RequestView) -> str:
    """`t_GPU = L/r_P + (G − 1)/r_D` with this request's own figures."""
    text = f"accelerator {v.accelerator_s:.3f} s"
    if v.r_P is not None:
        text += f" = {v.prefill_new:,} prefill tokens / r_P {v.r_P:,.0f} tok/s"
    if v.r_D is not None:
        text += f" + {v.decode_calls:,} decode calls / r_D {v.r_D:,.0f} /s"
    return text


def in_filter(view: RequestView, which: str) -> bool:
    if which == "all":
        return True
    if which == "waiting":
        return view.status in ("waiting", "preempted", "swapped")
    if which == "finished":
        return view.status not in LIVE
    return view.status == which


class RequestsScreen(Screen):
    """All requests of the latest snapshot; the app feeds `show(snapshot)`."""

    DEFAULT_CSS = """
    RequestsScreen DataTable { height: 2fr; }
    RequestsScreen #request-detail { height: 1fr; border: round $primary; padding: 0 1;
                                     overflow-y: auto; }
    """
    BINDINGS = [
        Binding("escape,l", "app.pop_screen", "Back", id="requests.back"),
        Binding("f", "next_filter", "Filter", id="requests.filter"),
        Binding("o", "next_sort", "Sort", id="requests.sort"),
        Binding("a", "abort", "Abort", id="requests.abort"),
        Binding("plus,equals_sign", "priority(-1)", "Prio+", id="requests.urgent"),
        Binding("minus", "priority(1)", "Prio-", id="requests.defer"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.filter = "all"
        self.sort = "state"
        self.views: dict[str, RequestView] = {}
        self.shown_ids: list[str] = []
        self.detail_id: str | None = None
        self._snap: EngineSnapshot | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)
        yield Static("Enter on a request shows its story here.", id="request-detail")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        if self.app.latest is not None:
            self.show(self.app.latest)

    # -- drawing ----------------------------------------------------------------------------

    def show(self, snap: EngineSnapshot) -> None:
        self._snap = snap
        views = [*snap.running, *snap.waiting, *snap.finished]
        self.views = {v.request_id: v for v in views}
        rows = [v for v in views if in_filter(v, self.filter)]
        key = {"arrival": lambda v: v.arrival_time,
               "state": lambda v: (STATE_ORDER.get(v.status, 3), v.arrival_time),
               "prompt": lambda v: -v.prompt_tokens, "out": lambda v: -v.output_tokens,
               "prio": lambda v: v.priority}[self.sort]
        rows.sort(key=key)
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        for v in rows:
            waited = (v.admitted_time if v.admitted_time is not None else snap.time) \
                - v.arrival_time
            table.add_row(v.request_id, Text(v.status, style=STATE_STYLE.get(v.status, "")),
                          f"{min(v.computed_tokens, v.prompt_tokens):,}/{v.prompt_tokens:,}",
                          f"{v.output_tokens}/{v.max_tokens}", f"{v.cached_tokens:,}",
                          f"{waited:.1f}", str(v.priority), str(v.num_preemptions),
                          f"{v.accelerator_s:.3f}", rate(v.r_P), rate(v.r_D),
                          key=v.request_id)
        self.shown_ids = [v.request_id for v in rows]
        # The cursor follows the request opened with Enter (its row moves as it finishes);
        # otherwise it stays on the same row.
        if self.detail_id in self.shown_ids:
            row = self.shown_ids.index(self.detail_id)
        if rows:
            table.move_cursor(row=min(row, len(rows) - 1))
        counts = {f: sum(in_filter(v, f) for v in views) for f in FILTERS}
        self.sub_title = (" · ".join(f"{n} {f}" for f, n in counts.items()) +
                          f" · filter {self.filter} (f) · sort by {self.sort} (o)")
        self._draw_detail(snap)

    def _draw_detail(self, snap: EngineSnapshot) -> None:
        d = snap.detail
        pane = self.query_one("#request-detail", Static)
        if self.detail_id is None:
            return
        if d is None or d.request_id != self.detail_id:
            pane.update(f"{self.detail_id}: waiting for the engine's next snapshot…")
            return
        text = Text(f"{d.request_id} · {d.status}" + (f" ({d.reason})" if d.reason and
                                                      d.reason != d.status else ""),
                    style="bold")
        text.append(f"\nprompt {d.num_prompt_tokens:,} tokens ({d.num_cached_tokens:,} from "
                    f"the prefix cache) · output {d.num_output_tokens:,} · priority "
                    f"{d.priority}")
        view = self.views.get(d.request_id)
        if view is not None and view.accelerator_s:
            text.append("\n" + occupancy(view))
        if d.block_table:
            blocks = set(d.block_table)
            path = [n for n in snap.prefix_nodes if n.block in blocks]
            text.append(f"\nblocks ({len(d.block_table)}): "
                        f"{' '.join(map(str, d.block_table[:48]))}"
                        + (" …" if len(d.block_table) > 48 else ""))
            if path:
                text.append("\nprefix path: " + " → ".join(
                    f"[{n.start_token}:{n.end_token})" for n in path))
        for t, what in d.events[-200:]:
            text.append(f"\n{t:10.3f} s  {what}")
        pane.update(text)

    # -- actions ----------------------------------------------------------------------------

    def selected(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count or table.cursor_row >= len(self.shown_ids):
            return None
        return self.shown_ids[table.cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()  # the app opens the knob editor for rows that bubble up to it
        rid = self.selected()
        if rid is None:
            return
        self.detail_id = rid
        self.app.watch_request(rid)
        if self._snap is not None:
            self._draw_detail(self._snap)

    def action_next_filter(self) -> None:
        self.filter = FILTERS[(FILTERS.index(self.filter) + 1) % len(FILTERS)]
        if self._snap is not None:
            self.show(self._snap)

    def action_next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        if self._snap is not None:
            self.show(self._snap)

    def action_abort(self) -> None:
        rid = self.selected()
        view = self.views.get(rid) if rid else None
        if view is None or view.status not in LIVE:
            self.notify("Select a running or waiting request to abort.", severity="warning")
            return
        self.app.engine.abort(rid, "aborted by the operator")
        self.notify(f"{rid} aborted; its blocks come back after the current step")

    def action_priority(self, delta: int) -> None:
        rid = self.selected()
        view = self.views.get(rid) if rid else None
        if view is None or view.status not in LIVE:
            self.notify("Select a running or waiting request.", severity="warning")
            return
        self.app.set_priority(rid, view.priority + delta)

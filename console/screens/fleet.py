"""`kvdeck attach URL1 URL2 …` (or `--fleet FILE`): every replica side by side — state,
running, waiting and why, KV usage, hit rate, tokens/s, recent TTFT and ITL percentiles
(histogram deltas between scrapes), cached blocks from its KV events — one fleet prefix tree
keyed by the tokens (a prefix cached on two replicas is one line with both marked), and what
a longest-prefix router would score each replica for a prompt typed below.

All figures come from `runtime/fleet/fleet.py`'s threads; this screen only draws them, once
per interval, so a slow or dead replica never blocks it.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Header, Input, Static

from kvdeck.console.base_app import ConsoleApp
from kvdeck.console.widgets.footer import KeysFooter
from kvdeck.runtime.fleet.fleet import Fleet, ReplicaRow
from kvdeck.runtime.fleet.fleet_tree import FleetSegment, fleet_segments

COLUMNS = ("replica", "state", "run", "wait", "KV", "hit", "gen tok/s", "TTFT p50/p99 ms",
           "ITL p50 ms", "cached blk", "said")
STATE_STYLE = {"up": "green", "stale": "yellow", "down": "red", "starting": "dim"}


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.0f}"


def row_cells(r: ReplicaRow, cache=None) -> tuple:
    st, rates = r.status, r.rates
    waiting = "—"
    if st is not None and st.waiting is not None:
        reasons = {k: v for k, v in (st.waiting_reasons or {}).items() if v}
        waiting = f"{st.waiting:.0f}" + (" (" + ", ".join(f"{k} {v:.0f}" for k, v in
                                                          reasons.items()) + ")"
                                         if reasons else "")
    gen = rates.generation_tokens_per_s if rates is not None else None
    ttft = f"{ms(r.ttft.quantile(0.5))}/{ms(r.ttft.quantile(0.99))}" \
        if r.ttft is not None and r.ttft.count else "—"
    itl = ms(r.itl.quantile(0.5)) if r.itl is not None and r.itl.count else "—"
    cached = "—"
    if cache is not None:  # from its events, against the pool /metrics gives
        cached = f"{cache.resident('GPU'):,}" + (f"/{st.num_gpu_blocks:,.0f}"
                                                 if st is not None and st.num_gpu_blocks else "")
    said = r.said
    if r.state == "stale" and r.age_s is not None:
        said = f"no answer for {r.age_s:,.0f} s: {said}"
    return (r.name, Text(r.state, style=STATE_STYLE.get(r.state, "")),
            "—" if st is None or st.running is None else f"{st.running:.0f}", waiting,
            pct(st.kv_usage if st else None), pct(st.hit_rate if st else None),
            "—" if gen is None else f"{gen:,.0f}", ttft, itl, cached,
            Text(said, style="red" if r.state == "down" else "yellow"))


def tree_text(segs: list[FleetSegment], decode=None, width: int = 80,
              down: frozenset[str] = frozenset()) -> Text:
    """The fleet tree's segments as indented lines; a replica in `down` is marked so (what
    it held is its last word, not its state now)."""
    depth = {0: -1}
    out = Text()
    for s in segs:
        d = depth[s.seg_id] = depth.get(s.parent_id, -1) + 1
        line = Text("  " * d + f"[{s.start_token}:{s.start_token + s.num_tokens})",
                    style="bold")
        if s.num_blocks > 1:
            line.append(f" {s.num_blocks} blocks", style="dim")
        for name, media in s.replicas:
            if name in down:
                line.append(f" {name}:{'+'.join(media)} (down)", style="dim strike")
            else:
                line.append(f" {name}:{'+'.join(media)}",
                            style="cyan" if media == ("GPU",) else "magenta")
        if decode is not None:
            room = max(width - len(line.plain) - 4, 8)
            line.append(f" “{decode(list(s.tokens[:48])).replace(chr(10), '⏎')[:room]}”",
                        style="green")
        out.append_text(line)
        out.append("\n")
    return out


class FleetApp(ConsoleApp):
    TITLE = "kvdeck attach — fleet"
    CSS = """
    #replicas { height: auto; max-height: 50%; }
    #said { height: auto; padding: 0 1; }
    #lower { height: 1fr; }
    #fleet-tree { width: 2fr; height: 100%; border: round $primary; padding: 0 1;
                  overflow-y: auto; }
    #router { width: 1fr; border: round $primary; padding: 0 1; }
    #router Static { height: 1fr; }
    """
    BINDINGS = [Binding("q", "quit", "Quit", id="fleet.quit"),
                Binding("t", "next_theme", "Theme", id="fleet.theme"),
                Binding("f1", "help", "Help", id="fleet.help")]

    def __init__(self, fleet: Fleet, interval_s: float = 1.0, tokenizer=None,
                 title: str | None = None):
        super().__init__()
        if title is not None:
            self.title = title
        self.fleet, self.interval_s, self.tokenizer = fleet, interval_s, tokenizer
        self.prompt: list[int] | None = None
        self.sub_title = f"{len(fleet)} replicas"

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="replicas", cursor_type="row", zebra_stripes=True)
        yield Static("", id="said")
        with Horizontal(id="lower"):
            tree = Static("no replica publishes KV events: give them as kv_events in a "
                          "fleet file (docs/attach.md)", id="fleet-tree")
            tree.border_title = "Fleet prefix tree (by content)"
            yield tree
            with Vertical(id="router"):
                yield Input(placeholder="a prompt: text (with --tokenizer) or token ids",
                            id="router-prompt")
                yield Static("", id="router-scores")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.setup_themes()
        self.query_one("#router").border_title = "Longest-prefix router"
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.fleet.start()
        self.refresh_view()
        self.every(self.interval_s, self.refresh_view)

    def on_unmount(self) -> None:
        self.fleet.stop()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            self.prompt = None
        elif all(part.strip().isdigit() for part in text.replace(",", " ").split()):
            self.prompt = [int(p) for p in text.replace(",", " ").split()]
        elif self.tokenizer is not None:
            self.prompt = self.tokenizer.encode(text)
        else:
            self.notify("Give token ids, or start attach with --tokenizer to type text.",
                        severity="warning")
            return
        self.refresh_view()

    def refresh_view(self) -> None:
        rows = self.fleet.rows()
        caches = self.fleet.caches()
        table = self.query_one(DataTable)
        cursor = table.cursor_row
        table.clear()
        for r in rows:
            table.add_row(*row_cells(r, caches.get(r.name)), key=r.name)
        if rows:
            table.move_cursor(row=min(cursor, len(rows) - 1))
        # What is wrong with each replica, also below the table: its column may be off-screen.
        said = Text()
        for r in rows:
            if r.said:
                said.append(f"{r.name}: {r.said}\n",
                            style="red" if r.state == "down" else "yellow")
        self.query_one("#said", Static).update(said)
        states = [r.state for r in rows]
        self.sub_title = f"{len(rows)} replicas · " + " · ".join(
            f"{states.count(s)} {s}" for s in ("up", "stale", "down", "starting")
            if states.count(s))
        pane = self.query_one("#fleet-tree", Static)
        if caches:
            segs = fleet_segments(self.fleet.tree())
            decode = self.tokenizer.decode if self.tokenizer is not None else None
            down = frozenset(r.name for r in rows if r.state == "down")
            pane.update(tree_text(segs, decode, pane.size.width, down) if segs else
                        Text("no full block cached on any replica yet", style="dim"))
        self._scores(caches)

    def _scores(self, caches) -> None:
        out = self.query_one("#router-scores", Static)
        if self.prompt is None:
            out.update(Text("Enter a prompt: each replica's score is its cached blocks of "
                            "the prompt in a row from the start, GPU 1.0, CPU 0.8 (llm-d's "
                            "precise prefix scorer).", style="dim"))
            return
        if not caches:
            out.update("no replica publishes KV events to score")
            return
        scores = self.fleet.scores(self.prompt)
        best = max(s.score for s in scores.values())
        text = Text(f"{len(self.prompt)} prompt tokens\n")
        for name, s in sorted(scores.items(), key=lambda kv: -kv[1].score):
            text.append(f"{name}: {s.score:.1f} ({s.blocks} blocks, {s.tokens} tokens)",
                        style="bold green" if s.score == best and best > 0 else "")
            text.append("\n")
        out.update(text)

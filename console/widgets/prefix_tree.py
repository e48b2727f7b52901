"""Prefix tree panel: the shared-prefix structure as a collapsible tree of token spans with
users, hits, the retention value (estimated hit chance `p`, `V_h = p·T_r` in ms of
recompute saved, and `p*`, the hit chance above which keeping it on the host tier pays;
live engines only), last access and evictability. The snapshot already folds single-child chains
into segments. The tree is rebuilt from each snapshot, keeping the segments the operator
collapsed and the cursor's segment.

The same panel shows a remote replica's cache as its KV events tell it (`kvdeck attach
--kv-events`: `show_segments`), with what events can say about each segment
(`remote_prefix.py`)."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.widgets import Tree

from kvdeck.console.widgets.remote_prefix import segment_label
from kvdeck.runtime.views.snapshot import EngineSnapshot


def _p(p: float) -> str:
    """A break-even probability: above 1 (or infinite) no hit rate makes the host pay."""
    return f"{p:.2g}" if p <= 1 else "never"


class PrefixTreePanel(Tree[int]):
    """Cached full blocks as a collapsible tree; node data is the segment's first node id."""

    DEFAULT_CSS = "PrefixTreePanel { height: 1fr; border: round $primary; }"
    BORDER_TITLE = "Prefix cache"

    def __init__(self, **kwargs) -> None:
        super().__init__("prefix cache", **kwargs)
        self.show_root = False
        self.collapsed_ids: set[int] = set()
        self.selected: str | None = None
        """Request whose path through the tree is highlighted."""
        self._snapshot: EngineSnapshot | None = None

    def on_tree_node_collapsed(self, event: Tree.NodeCollapsed) -> None:
        if event.node.data is not None:
            self.collapsed_ids.add(event.node.data)

    def on_tree_node_expanded(self, event: Tree.NodeExpanded) -> None:
        self.collapsed_ids.discard(event.node.data)

    def on_resize(self, _: events.Resize) -> None:
        if self._snapshot is not None:
            self.show(self._snapshot)

    def show(self, snap: EngineSnapshot) -> None:
        self._snapshot = snap
        kv = snap.kv
        demoted = snap.transfers.counters["demotions"] if snap.transfers is not None else 0
        self.border_subtitle = (f"{kv.num_cached_blocks} cached blocks · "
                                f"hit rate {kv.hit_rate:.0%} · {kv.num_evictions} dropped"
                                + (f" · {demoted} demoted" if demoted else ""))
        cursor = self.cursor_node.data if self.cursor_node is not None else None
        self.clear()
        nodes = snap.prefix_nodes
        self.show_root = not nodes
        if not nodes:
            self.root.set_label(Text(
                "empty: no full block has been computed yet" if snap.knobs.enable_prefix_caching
                else "prefix caching is off (knob enable_prefix_caching)", style="dim"))
            return
        path = next((set(v.block_table) for v in snap.running
                     if v.request_id == self.selected), set())
        rows = []
        for n in nodes:
            on_path = n.block >= 0 and n.block in path
            label = Text(f"[{n.start_token}:{n.end_token})",
                         style="bold yellow" if on_path else "bold")
            if n.num_blocks > 1:
                label.append(f" {n.num_blocks} blocks", style="dim")
            label.append(f" users {n.num_users} hits {n.hits}")
            if n.value_ms is not None:  # V_h = p·T_r; on the host it pays above p*
                label.append(f" p {n.p_hit:.2f} V {n.value_ms:.2g} ms p* "
                             f"{_p(n.break_even)}", style="cyan")
            label.append(f" last step {n.last_access}")
            if n.on_host:
                label.append(" on host (demoted)", style="yellow")
            elif n.evictable:
                label.append(" evictable", style="blue")
            if on_path:
                label.append(f" ◀ {self.selected}", style="bold yellow")
            rows.append((n.node_id, n.parent_id, label))
        self._fill(rows, cursor)

    def show_segments(self, segs: list, decode=None, subtitle: str = "") -> None:
        """A remote replica's cached segments (`fleet_tree.Segment`, parents first), each
        labelled with what its KV events say (`decode(tokens) -> str` adds its text)."""
        self.border_subtitle = subtitle
        cursor = self.cursor_node.data if self.cursor_node is not None else None
        self.clear()
        self.show_root = not segs
        if not segs:
            self.root.set_label(Text("no cached block announced yet", style="dim"))
            return
        width = max(self.size.width - 6, 40)
        self._fill([(s.seg_id, s.parent_id, segment_label(s, decode, width)) for s in segs],
                   cursor)

    def _fill(self, rows: list[tuple[int, int, Text]], cursor: int | None) -> None:
        """Add `(id, parent id, label)` rows, parents first (parent 0: the root), keeping
        what the operator collapsed and the cursor's row."""
        branches = {0: self.root}
        parents = {parent for _, parent, _ in rows}
        for node_id, parent_id, label in rows:
            parent = branches.get(parent_id, self.root)
            if node_id in parents:
                node = parent.add(label, data=node_id, expand=node_id not in self.collapsed_ids)
            else:
                node = parent.add_leaf(label, data=node_id)
            branches[node_id] = node
            if node_id == cursor:
                self.move_cursor(node)

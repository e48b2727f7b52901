"""Prefix tree panel: the shared-prefix structure with token spans, users, hits, last access
and evictability; the snapshot already folds single-child chains into segments."""

from __future__ import annotations

from rich.text import Text
from rich.tree import Tree

from console.widgets.base import SnapshotPanel
from runtime.snapshot import EngineSnapshot


class PrefixTreePanel(SnapshotPanel):
    """Cached full blocks as a tree of token spans."""

    DEFAULT_CSS = "PrefixTreePanel { height: 1fr; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Prefix cache"

    selected: str | None = None
    """Request whose path through the tree is highlighted."""

    def draw(self, snap: EngineSnapshot) -> None:
        kv = snap.kv
        self.border_subtitle = (f"{kv.num_cached_blocks} cached blocks · "
                                f"hit rate {kv.hit_rate:.0%} · {kv.num_evictions} evicted")
        nodes = snap.prefix_nodes
        if not nodes:
            self.update(Text("empty: no full block has been computed yet"
                             if snap.knobs.enable_prefix_caching else
                             "prefix caching is off (knob enable_prefix_caching)", style="dim"))
            return
        root = Tree(Text(f"{len(nodes)} segments shown (chains folded)", style="dim"))
        branches: dict[int, Tree] = {0: root}
        path = next((set(v.block_table) for v in snap.running
                     if v.request_id == self.selected), set())
        for n in nodes[: max(self.size.height - 3, 4)]:
            on_path = n.block in path
            label = Text(f"[{n.start_token}:{n.end_token})",
                         style="bold yellow" if on_path else "bold")
            if n.num_blocks > 1:
                label.append(f" {n.num_blocks} blocks", style="dim")
            label.append(f" users {n.num_users} hits {n.hits} @{n.last_access:.1f}s")
            if n.evictable:
                label.append(" evictable", style="blue")
            if on_path:
                label.append(f" ◀ {self.selected}", style="bold yellow")
            parent = branches.get(n.parent_id, root)
            branches[n.node_id] = parent.add(label)
        self.update(root)

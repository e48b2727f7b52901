"""What the panels show, as plain text, for tests that compare two consoles panel by panel."""

from __future__ import annotations

import io

from rich.console import Console
from textual.dom import DOMNode
from textual.widgets import Static, Tree

from kvdeck.console.layout import SNAPSHOT_PANELS


def panel_text(widget: Static) -> str:
    """A Static panel's content rendered at its width (its content may be any renderable)."""
    console = Console(width=widget.size.width or 120, file=io.StringIO(), record=True)
    console.print(widget.content)
    title = widget.border_title or ""
    subtitle = widget.border_subtitle or ""
    return f"{title}\n{subtitle}\n{console.export_text()}"


def tree_text(tree: Tree) -> str:
    lines = [str(tree.border_subtitle or "")]

    def walk(node, depth: int) -> None:
        for child in node.children:
            lines.append("  " * depth + child.label.plain)
            walk(child, depth + 1)
    if tree.show_root:
        lines.append(tree.root.label.plain)
    walk(tree.root, 0)
    return "\n".join(lines)


def panels_text(screen: DOMNode) -> dict[str, str]:
    """Every snapshot panel of `screen`, by panel class name."""
    out = {}
    for cls in SNAPSHOT_PANELS:
        widget = screen.query_one(cls)
        out[cls.__name__] = tree_text(widget) if isinstance(widget, Tree) else panel_text(widget)
    return out

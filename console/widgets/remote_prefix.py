"""A remote replica's prefix cache as its KV events tell it (`kvdeck attach --kv-events`):
the label of each segment in the prefix tree panel (`PrefixTreePanel.show_segments`) —
token span, blocks, where it lives (medium and KV-cache groups), its text where a
tokenizer is given — and, for placeholders, that they were stored before kvdeck attached.
What events cannot say (users, hits, eviction order) is said once, not guessed."""

from __future__ import annotations

from rich.text import Text

from kvdeck.runtime.fleet.fleet_tree import Segment

UNKNOWN = ("events do not say which requests use a block, how often it was hit, or what "
           "goes next: those come from /metrics where the server exposes them")


def span(s: Segment) -> str:
    if s.placeholder:
        return "[? stored before kvdeck attached]"
    if s.start_token is None:
        return f"[?+{s.num_blocks * s.block_size} tokens: its prefix is not known]"
    return f"[{s.start_token}:{s.end_token})"


def groups(s: Segment) -> str:
    g = [x for x in s.groups if x is not None]
    if not g:
        return ""
    if g == list(range(g[0], g[-1] + 1)) and len(g) > 2:
        return f" groups {g[0]}–{g[-1]}"
    return " group" + ("s " if len(g) > 1 else " ") + ",".join(map(str, g))


def segment_label(s: Segment, decode=None, width: int = 80) -> Text:
    """One segment as a tree label: its span, blocks, where it lives (medium and groups),
    and its text when `decode(tokens) -> str` is given; a placeholder says what it is."""
    line = Text(span(s), style="bold" if not s.placeholder else "yellow")
    if s.num_blocks > 1:
        line.append(f" {s.num_blocks} blocks", style="dim")
    if not s.placeholder:
        line.append(" " + "+".join(s.media), style="cyan" if s.media == ("GPU",)
                    else "magenta")
        line.append(groups(s), style="dim")
    if decode is not None and s.tokens:
        room = max(width - len(line.plain) - 4, 8)
        text = decode(list(s.tokens[:64])).replace("\n", "⏎")
        line.append(f" “{text[:room]}”", style="green")
    return line

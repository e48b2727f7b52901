"""A remote replica's prefix cache as its KV events tell it (`kvdeck attach --kv-events`):
one line per segment, indented by depth — token span, blocks, where it lives (medium and
KV-cache groups), its text where a tokenizer is given — and, for placeholders, that they
were stored before kvdeck attached. What events cannot say (users, hits, eviction order)
is said once, not guessed."""

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


def segment_text(segs: list[Segment], decode=None, width: int = 80,
                 limit: int = 200) -> Text:
    """The segments as indented lines (`decode(tokens) -> str` adds their text)."""
    depth: dict[int, int] = {0: -1}
    out = Text()
    for s in segs[:limit]:
        d = depth[s.seg_id] = depth.get(s.parent_id, -1) + 1
        line = Text("  " * d + span(s), style="bold" if not s.placeholder else "yellow")
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
        out.append_text(line)
        out.append("\n")
    if len(segs) > limit:
        out.append(f"… {len(segs) - limit} more segments\n", style="dim")
    return out

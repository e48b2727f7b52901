"""F1 help: keys and what each panel shows."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """
# kvdeck

**Keys** — `p` pause/resume · `s` step one iteration (paused) · `+`/`-` traffic rate ·
`k` knobs (Enter edits, applied at the next iteration) · `n` highlight a request's blocks ·
`/` type a prompt (its tokens stream below; its blocks and prefix path are highlighted) ·
`r` start/stop recording to `runs/<time>/` · `t` next theme · `ctrl+p` command palette ·
`F1` this help · `q` quit.

**Queue** — the last iteration's tokens: decode (cyan) + prefill chunks (magenta) against the
token budget; running requests (prompt tokens computed, output of max), then waiting ones
with time waited, deadline slack and priority.

**KV blocks** — every physical block: `█` green private, magenta shared by several requests,
cyan cached and in use, `▒` blue cached and evictable, `·` free; `◆` the highlighted request.

**Prefix cache** — cached full blocks as a tree of token spans, with users, hits, last
access and evictability; single-child chains are folded.

**Metrics** — TTFT / ITL / TPOT / E2E percentiles over recent requests, throughput, KV usage
and hit rate over time; `┃` marks a knob change.

Replay a recording with `kvdeck replay RUN`.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 100; height: 90%;
                                  border: thick $accent; background: $surface; }
    """
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close", id="help.close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)

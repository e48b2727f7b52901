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
`k` knobs (Enter edits: enum knobs list their values; a pending change shows
`old → new (next step)`) · `l` request table · `c` charts · `n` highlight a request's blocks ·
`/` type a prompt (Enter sends, Escape leaves) · `r` start/stop recording to `runs/<time>/` ·
`w` save the settings and knobs to `runs/settings-<time>.toml` · `t` next theme ·
`ctrl+p` command palette · `F1` this help · `q` quit.

**Queue** — the last iteration's tokens: decode (cyan) + prefill chunks (magenta) against the
token budget, and why waiting requests did not join (token budget, sequence limit, KV pool
full, admission control); running requests (prompt tokens computed, output of max), then
waiting ones with time waited, deadline slack and priority.

**Request table** (`l`) — every request, `f` filter by state, `o` sort, Enter its story
(admission, prefill chunks, first token, preemptions, finish) with its blocks highlighted in
the KV map, `a` abort, `+`/`-` priority, Escape back.

**KV blocks** — every physical block: `█` green private, magenta shared by several requests,
cyan cached and in use, `▒` blue cached and evictable, `·` free; `◆` the highlighted request.

**Prefix cache** — cached full blocks as a tree of token spans, with users, hits, last
access and evictability; single-child chains are folded.

**Metrics** — TTFT / ITL / TPOT / E2E percentiles over recent requests, finished requests,
arrivals and tokens per second, resident requests against Little's law, KV usage and hit rate
over time; `┃` marks a knob change. **Charts** (`c`): request rate, prompt and generation
tokens/s, step time and KV usage over the last hour with axes; `▲` marks a knob change.
**Plan** (`P`): the planner's memory-vs-completion plane for the workload the engine is
seeing (every scheme a letter, `@` the engine measured, `¦` the KV pool, `┄` the deadline),
with each scheme's verdict and `▶` on the one the knobs make now.

**Prompt** — an instruct model (chat template in its GGUF) is asked as a chat; a base model
(the embedded Gemma 3 270M) continues the text, and the panel says so.

Replay a recording with `kvdeck replay RUN` (`--summary` for its figures).
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

"""Interactive prompt: type a prompt, watch its tokens stream; the app highlights its blocks
and its prefix-tree path."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Static

from runtime.snapshot import TrackedOutput


class PromptPanel(Vertical):
    DEFAULT_CSS = """
    PromptPanel { height: 5; dock: bottom; }
    PromptPanel Input { height: 3; }
    PromptPanel #prompt-output { height: 2; padding: 0 1; color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        yield Input(placeholder="/ to type a prompt, Enter sends it (greedy, 48 tokens)",
                    id="prompt-input")
        yield Static("", id="prompt-output")

    def show_tracked(self, t: TrackedOutput | None) -> None:
        """Show the followed request's text so far (from the latest snapshot)."""
        out = self.query_one("#prompt-output", Static)
        if t is None:
            out.update("")
            return
        line = Text(f"{t.request_id} [{t.status}, {t.num_output_tokens} tokens] ", style="bold")
        line.append(t.text.replace("\n", " ⏎ ")[-400:])
        out.update(line)

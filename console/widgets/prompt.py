"""Interactive prompt: type a prompt, watch its tokens stream; the app highlights its blocks
and its prefix-tree path."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Static

from runtime.request import Request


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

    def show_request(self, req: Request | None) -> None:
        out = self.query_one("#prompt-output", Static)
        if req is None:
            out.update("")
            return
        text = req.output_text
        body = text if text is not None else " ".join(map(str, req.output_token_ids))
        line = Text(f"{req.request_id} [{req.status.value}, {req.num_output_tokens} tokens] ",
                    style="bold")
        line.append(body.replace("\n", " ⏎ ")[-400:])
        out.update(line)

"""Interactive prompt: type a prompt, watch its tokens stream; the app highlights its blocks
and its prefix-tree path.

An instruct model (its GGUF carries a chat template) is asked as a chat: the prompt goes
through the template and the answer stops at the end of the turn. A base model has no chat
template, so the prompt is a plain completion: the model continues the text, and the panel
says so. Escape (or Enter) leaves the input, so the console's keys work again; the answer
wraps and scrolls.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Input, Static

from kvdeck.runtime.views.snapshot import TrackedOutput

CHAT_MAX_TOKENS = 256
COMPLETION_MAX_TOKENS = 48


def prompt_mode(tokenizer) -> tuple[bool, str]:
    """(chat?, a line saying how prompts are run) for the engine's tokenizer."""
    if tokenizer is None:
        return False, "no tokenizer: the prompt's bytes stand in for tokens"
    if getattr(tokenizer, "is_instruct", False):
        return True, "instruct model: asked as a chat through its template"
    if tokenizer.architecture == "stand-in":
        return False, "simulated model: words stand in for tokens"
    return False, ("base model (no chat template): the text is continued, not answered; "
                   "an instruct GGUF answers questions")


class PromptInput(Input):
    """The prompt's input line; Escape gives the keys back to the console."""

    BINDINGS = [Binding("escape", "leave", "Leave prompt", id="prompt.leave")]

    def action_leave(self) -> None:
        self.screen.set_focus(None)


class PromptPanel(Vertical):
    DEFAULT_CSS = """
    PromptPanel { height: auto; max-height: 9; dock: bottom; margin-bottom: 1; }
    /* margin-bottom: the footer docks to the same edge and would hide the last line. */
    PromptPanel Input { height: 3; }
    PromptPanel #prompt-scroll { height: auto; max-height: 6; padding: 0 1; }
    PromptPanel #prompt-output { color: $text-muted; }
    """

    def __init__(self, mode: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode = mode

    def compose(self) -> ComposeResult:
        yield PromptInput(placeholder=f"/ to type a prompt (options first: n=4 temp=0.8 "
                                      f"json={{...}} regex=... choice=a|b) · Enter sends it · "
                                      f"Esc leaves · {self.mode}", id="prompt-input")
        with VerticalScroll(id="prompt-scroll"):
            yield Static("", id="prompt-output")

    def show_tracked(self, t: TrackedOutput | None) -> None:
        """Show the followed request's text so far (from the latest snapshot), wrapped, and
        keep the newest line in view: each sample on its own line when it asked for several,
        tokens a constraint forced underlined."""
        out = self.query_one("#prompt-output", Static)
        if t is None:
            out.update("")
            return
        text = tracked_text(t)
        for i, b in enumerate(t.branches, 1):
            text.append("\n")
            text.append_text(tracked_text(b, f"  sample {i + 1}"))
        out.update(text)
        scroll = self.query_one("#prompt-scroll", VerticalScroll)
        scroll.scroll_end(animate=False)
        # And again once the new lines are laid out (they may add to the end).
        self.call_after_refresh(scroll.scroll_end, animate=False)


FORCED_STYLE = "underline dim"
"""How tokens a constraint forced are shown (the grammar allowed nothing else there)."""


def tracked_text(t: TrackedOutput, name: str | None = None) -> Text:
    """One followed sample: its id (or `name`), status and tokens, the constraint it
    follows, then its text with forced runs marked."""
    head = f"{name or t.request_id} [{t.status}, {t.num_output_tokens} tokens"
    if t.constraint and name is None:
        head += f", {t.constraint}; forced underlined"
    line = Text(head + "] ", style="bold")
    if t.segments:
        for piece, forced in t.segments:
            line.append(piece, style=FORCED_STYLE if forced else "")
    else:
        line.append(t.text)
    return line

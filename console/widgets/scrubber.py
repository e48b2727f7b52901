"""Replay scrubber: position, speed and play state over a bar of the run; knob changes are
marked; a click seeks."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.message import Message
from textual.widgets import Static


class Scrubber(Static):
    DEFAULT_CSS = "Scrubber { height: 2; padding: 0 1; background: $panel; }"

    class Seek(Message):
        def __init__(self, position: int) -> None:
            super().__init__()
            self.position = position

    def __init__(self, total: int, marks: set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.total = total
        self.marks = marks
        """Record indices where knobs changed."""

    _args: tuple | None = None

    def on_resize(self, _: events.Resize) -> None:
        if self._args is not None:
            self.draw(*self._args)

    def draw(self, position: int, step: int, time: float, speed: float, playing: bool) -> None:
        self._args = (position, step, time, speed, playing)
        if not self.total:
            self.update(Text(f"step {step} · t = {time:,.2f} s: the state when the recording "
                             "began; no iteration ran while it recorded (it was paused)"))
            return
        width = max(self.size.width - 2, 10)
        at = min(position * width // self.total, width - 1)
        bar = Text()
        for x in range(width):
            lo, hi = x * self.total // width, (x + 1) * self.total // width
            mark = any(lo <= m < max(hi, lo + 1) for m in self.marks)
            if x == at:
                bar.append("●", style="bold yellow")
            else:
                bar.append("┃" if mark else "━", style="magenta" if mark else
                           ("cyan" if x < at else "dim"))
        state = "▶ playing" if playing else "⏸ paused"
        self.update(Text(f"{state} · record {position + 1}/{self.total} · step {step} · "
                         f"t = {time:,.2f} s · speed ×{speed:g}  "
                         "(space play, ←/→ step, pgup/pgdn ×50, home/end, [ ] speed)\n")
                    .append_text(bar))

    def on_click(self, event: events.Click) -> None:
        if not self.total:
            return
        width = max(self.size.width - 2, 10)
        self.post_message(self.Seek(min(max(event.x - 1, 0), width - 1) * self.total // width))

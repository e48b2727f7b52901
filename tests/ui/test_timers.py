"""The console's timers (`ConsoleApp.every`) while the app closes."""

from __future__ import annotations

import asyncio

from textual.app import ComposeResult
from textual.widgets import Static

from kvdeck.console.base_app import ConsoleApp


class SlowToLeave(Static):
    """A widget whose unmount takes a while, so the app's closing lasts long enough for its
    timer to tick many times inside it."""

    async def on_unmount(self) -> None:
        self.app.closing = True
        await asyncio.sleep(0.3)


class TickingApp(ConsoleApp):
    def __init__(self) -> None:
        super().__init__()
        self.closing, self.ticks, self.late = False, 0, 0

    def compose(self) -> ComposeResult:
        yield SlowToLeave("x")

    def on_mount(self) -> None:
        self.every(0.01, self.tick)

    def tick(self) -> None:
        self.ticks += 1
        self.late += self.closing


async def test_a_timer_never_ticks_while_the_app_closes() -> None:
    app = TickingApp()
    async with app.run_test() as pilot:
        await pilot.pause(0.2)
    assert app.closing and app.ticks > 0
    assert app.late == 0

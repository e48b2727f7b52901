"""SVG snapshots of the live, help, request-table and charts screens at 80×24 and 160×48,
from a seeded sim run."""

from __future__ import annotations

import pytest

from kvdeck.console.screenshots import advance
from kvdeck.console.screenshots import make_demo_app as make_app

SIZES = [(80, 24), (160, 48)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_live_screen(snap_compare, size) -> None:
    async def run_before(pilot) -> None:
        advance(pilot.app, 60)
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help_screen(snap_compare, size) -> None:
    assert snap_compare(make_app(), terminal_size=size, press=["f1"])


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("key", ["l", "c"], ids=["requests", "charts"])
def test_request_table_and_charts(snap_compare, size, key: str) -> None:
    async def run_before(pilot) -> None:
        advance(pilot.app, 300)
        await pilot.pause()
        await pilot.press(key)
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)

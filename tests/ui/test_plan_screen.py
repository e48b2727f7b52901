"""The plan screen (`P`) on the seeded sim console: the planner's plane for the workload the
engine is seeing, with the engine's measured point, recomputed as knobs change."""

from __future__ import annotations

from kvdeck.console.screens.plan import PlanScreen
from kvdeck.console.screenshots import advance
from kvdeck.runtime.planning.live_plan import live_workload
from tests.ui.panel_text import panel_text


async def wait_for_plan(pilot, app) -> str:
    """The screen's text once its profiles are read and a plan drawn."""
    for _ in range(100):
        await pilot.pause(0.05)
        text = panel_text(app.screen.query_one("#plan"))
        if "workload seen" in text:
            return text
    raise AssertionError(f"no plan drawn: {text!r}")


async def test_plan_screen_shows_every_scheme_the_measured_point_and_follows_knobs(app) -> None:
    async with app.run_test(size=(160, 60)) as pilot:
        advance(app, 400)
        await pilot.press("P")
        assert isinstance(app.screen, PlanScreen)
        text = await wait_for_plan(pilot, app)
        live = live_workload(app.latest)
        w = live.workload
        assert f"workload seen: {w.prompt_tokens} in / {w.output_tokens} out" in text
        for name in ("baseline", "q8_0 KV", "q4_0 KV"):
            assert f" {name} " in text
        assert "@ measured:" in text and "mean E2E" in text and "@" in text.split("@ measured")[0]
        assert "▶ shared prefix " in text or "▶ baseline " in text  # the knobs now (bf16)
        # A knob change moves the marker to the scheme the knobs now make.
        assert app.apply_knob("kv_format", "q8_0")
        advance(app, 5)
        app.screen.show(app.latest, force=True)
        await pilot.pause()
        text = panel_text(app.screen.query_one("#plan"))
        row = next(line for line in text.splitlines()
                   if "▶ " in line and "the scheme the knobs make" not in line)
        assert "q8_0 KV" in row
        await pilot.press("escape")
        assert app.screen is app.screen_stack[0]

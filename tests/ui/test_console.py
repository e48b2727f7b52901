"""Pilot tests: knobs through the UI, invalid values, stepping, recording, the live loop."""

from __future__ import annotations

import asyncio

from textual.widgets import Input

from console.app import KvdeckApp
from console.screenshots import advance
from console.screenshots import make_demo_app as make_app
from console.widgets.kv_map import KVMapPanel
from runtime.recording import read_iterations


async def edit_knob(pilot, app: KvdeckApp, name: str, text: str) -> None:
    table = app.query_one("#knobs")
    await pilot.press("k")
    table.move_cursor(row=table.get_row_index(name))
    await pilot.press("enter")
    await pilot.pause()
    app.screen.query_one(Input).value = text
    await pilot.press("enter")
    await pilot.pause()


async def test_knob_change_applies_at_next_iteration(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 5)
        await edit_knob(pilot, app, "max_num_batched_tokens", "512")
        assert app.engine.scheduler.knobs.max_num_batched_tokens == 4096  # not yet
        trace: list[dict] = []
        app.engine.recorder = trace.append
        advance(app, 1)
        assert app.engine.scheduler.knobs.max_num_batched_tokens == 512
        assert trace[0]["knobs"] == {"max_num_batched_tokens": 512}
        assert sum(n for _, _, n, _ in trace[0].get("plan", [])) <= 512
        await pilot.pause()
        assert str(app.query_one("#knobs").get_cell("max_num_batched_tokens",
                                                    app.query_one("#knobs")._value_col)) == "512"
        assert app.query_one("#metrics").marks  # the change is marked on the charts


async def test_invalid_knob_notifies_and_changes_nothing(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 3)
        before = app.engine.scheduler.knobs
        await edit_knob(pilot, app, "chunk_size", "-5")
        await edit_knob(pilot, app, "queue_policy", "random")
        await edit_knob(pilot, app, "max_num_seqs", "lots")
        advance(app, 2)
        assert app.engine.scheduler.knobs == before
        messages = [n.message for n in app._notifications]
        assert "chunk_size must be an integer from 1 to 1,048,576, got -5." in messages
        assert "queue_policy must be one of fcfs, priority, sjf, edf, got 'random'." in messages
        assert "max_num_seqs must be an integer, got 'lots'." in messages


async def test_traffic_rate_keys_and_step(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        rate = app.traffic.mix.rate_per_s
        await pilot.press("plus")
        assert app.traffic.mix.rate_per_s == rate * 1.5
        await pilot.press("minus")
        assert abs(app.traffic.mix.rate_per_s - rate) < 0.01
        step = app.engine.step_count
        await pilot.press("s")
        await pilot.press("s")
        assert app.engine.step_count == step + 2


async def test_highlight_a_requests_blocks(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 20)
        await pilot.press("n")
        kv = app.query_one(KVMapPanel)
        assert kv.selected == app.latest.running[0].request_id
        assert "◆" in kv.grid.plain


async def test_recording_writes_a_replayable_run(tmp_path) -> None:
    app = make_app(tmp_path / "runs")
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("r")
        advance(app, 30)
        await pilot.press("r")
        assert app.recorder is None
    (run,) = (tmp_path / "runs").iterdir()
    header, records = read_iterations(run)
    assert header["num_blocks"] == app.engine.kv.num_blocks and len(records) >= 20
    arrivals = (run / "arrivals.jsonl").read_text().splitlines()
    assert arrivals and '"prompt_tokens"' in arrivals[0]


async def test_live_loop_streams_snapshots_and_quits_cleanly(tmp_path) -> None:
    app = make_app(tmp_path / "runs", autostart=True)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(200):
            await asyncio.sleep(0.05)
            if app.latest is not None and app.latest.step > 20:
                break
        assert app.latest.step > 20 and app.loop.is_alive
        await pilot.press("p")
        assert app.loop.paused
        await pilot.press("q")
    assert not app.loop.is_alive and app.loop.error is None
    app.engine.check_integrity()

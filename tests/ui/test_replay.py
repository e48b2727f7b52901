"""Replay: a recorded run drives the same panels; scrubbing forward and back (through
checkpoints) shows exactly the state the trace rebuilds at that iteration."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvdeck.console.app import KvdeckApp
from kvdeck.console.layout import SNAPSHOT_PANELS
from kvdeck.console.screens import replay as replay_mod
from kvdeck.console.screens.replay import ReplayApp
from kvdeck.console.screenshots import advance, make_demo_app
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.console.widgets.scrubber import Scrubber
from kvdeck.runtime.core.commands import Pause
from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.executors.sim import SimExecutor
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.runs.traffic import TrafficGenerator, TrafficMix
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from kvdeck.runtime.views.snapshot import EngineSnapshot, snapshot_of
from tests.ui.panel_text import panel_text, panels_text


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    engine = Engine(EngineConfig(block_size=16, num_blocks=600, seed=5,
                                 knobs=Knobs(max_num_batched_tokens=1024, chunk_size=256)),
                    SimExecutor(seed=5))
    rec = record_headless(engine, tmp_path / "run")
    arrivals = [Arrival(0.05 * i, 300 + 40 * (i % 5), 20, prefix_group="sys", prefix_len=256)
                for i in range(30)]
    engine.set_knobs(chunk_size=128)
    run_arrivals(engine, arrivals, vocab_size=32_000, on_arrival=rec.arrival)
    rec.close()
    return tmp_path / "run"


def rebuilt(run: Path, n: int) -> bytes:
    replay = Replay(*read_run(run))
    state = replay.initial_state()
    for r in replay.steps[:n]:
        state.apply(r)
    return state.block_states()


async def test_scrub_forward_and_back(run_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(replay_mod, "CHECKPOINT", 16)  # exercise checkpoint restores
    app = ReplayApp(run_dir)
    async with app.run_test(size=(160, 48)) as pilot:
        total = len(app.records)
        assert total > 60
        await pilot.press("end")
        assert app.position == total - 1
        assert app.snapshot.kv.states == rebuilt(run_dir, total)
        assert app.snapshot.num_finished == 30
        await pilot.press("home", "pagedown", "right", "right")
        assert app.position == 52
        assert app.query_one(KVMapPanel)._snapshot.kv.states == rebuilt(run_dir, 53)
        await pilot.press("pageup")  # backwards: restore a checkpoint, re-apply
        assert app.position == 2 and app.snapshot.kv.states == rebuilt(run_dir, 3)
        assert len(app.checkpoints) > 2
        await pilot.press("right_square_bracket", "left_square_bracket", "space")
        assert app.playing
        await pilot.pause(0.3)
        await pilot.press("space")
        assert not app.playing and app.position > 2  # it played forward, then paused
        assert app.marks  # the knob change is marked on the scrubber


async def record_live(live, steps_before: int, steps: int) -> dict[int, EngineSnapshot]:
    """Run `live` under load, press r mid-run, keep the snapshot the panels drew at each
    recorded step, press r again; the live snapshots by step."""
    shown: dict[int, EngineSnapshot] = {}
    async with live.run_test(size=(160, 48)) as pilot:
        for _ in range(20_000):  # a real model's clock runs on the wall: wait for the load
            snap = live.latest
            if snap and snap.step >= steps_before and snap.running and snap.kv.num_cached_blocks:
                break  # requests in flight, prefixes cached
            advance(live, 1)
            time.sleep(0.001)
        else:
            raise AssertionError("the engine never came under load")
        await pilot.press("r")
        while len(shown) < steps:
            advance(live, 1)
            await pilot.pause()
            shown[live.latest.step] = live.latest
        await pilot.press("r")
        advance(live, 1)  # the stop is taken at the next iteration
        live.engine.check_integrity()
    return shown


async def replay_equals_live(run: Path, live: dict[int, EngineSnapshot]) -> None:
    """Every panel drawn from the replay equals the same panel drawn (at the same size) from
    the live snapshot of that step."""
    app = ReplayApp(run)
    async with app.run_test(size=(160, 48)) as pilot:
        assert app.records[0].step > 0  # the recording began mid-run
        compared = 0
        for position in range(len(app.records)):
            app.seek(position)
            await pilot.pause()
            step = app.snapshot.step
            if step in live:
                replayed = panels_text(app)
                # A segment's retention value is the live engine's (its recompute cost,
                # an online fit on a real executor): a replay shows none.
                shown = replace(live[step], prefix_nodes=tuple(
                    n._replace(p_hit=None, value_ms=None, break_even=None)
                    for n in live[step].prefix_nodes))
                for panel in SNAPSHOT_PANELS:
                    app.query_one(panel).show(shown)
                assert replayed == panels_text(app), f"panels differ at step {step}"
                compared += 1
        assert compared >= len(live) - 1
        await pilot.press("end")
        assert app.snapshot.kv.states == rebuilt(run, len(app.records))
    assert app.problem is None


async def test_a_sim_console_recording_started_mid_run_replays_panel_for_panel(tmp_path):
    live = make_demo_app(tmp_path / "runs")
    shown = await record_live(live, steps_before=60, steps=40)
    (run,) = (tmp_path / "runs").iterdir()
    await replay_equals_live(run, shown)


async def test_a_torch_console_recording_started_mid_run_replays_panel_for_panel(
        tmp_path, tiny_llama):
    resolved = resolve({"executor": "torch", "model": str(tiny_llama), "device": "cpu",
                        "dtype": "fp32", "kv_format": "fp32", "num_blocks": 64,
                        "block_size": 16, "max_num_batched_tokens": 256, "chunk_size": 64,
                        "seed": 4})
    session = build_session(resolved, live=False, with_tokenizer=False)  # random weights
    mix = TrafficMix(rate_per_s=200.0, long_fraction=0.5, short_prompt=24, short_output=12,
                     long_prompt=96, shared_prefix=64, long_output=16)
    traffic = TrafficGenerator(session.engine, mix, session.executor.info.vocab_size,
                               seed=4)
    live = KvdeckApp(session.engine, traffic, autostart=False, hardware=False,
                     runs_dir=tmp_path / "runs", settings=resolved)
    shown = await record_live(live, steps_before=12, steps=24)
    (run,) = (tmp_path / "runs").iterdir()
    await replay_equals_live(run, shown)


async def test_replay_charts_follow_the_scrubber(run_dir: Path) -> None:
    app = ReplayApp(run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("end", "c")
        text = panel_text(app.screen.query_one("#charts"))
        assert "generation tokens/s" in text and "▲" in text  # the knob change is marked
        await pilot.press("home")
        assert panel_text(app.screen.query_one("#charts")) != text
        await pilot.press("escape")
        assert app.screen is app.screen_stack[0]


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_replay_screen(snap_compare, run_dir: Path, size) -> None:
    assert snap_compare(ReplayApp(run_dir), terminal_size=size, press=["pagedown"])


def test_bad_run_directory_is_one_sentence(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "replay", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not a kvdeck run directory (no header.json)." in r.stderr


async def test_a_damaged_run_stops_the_replay_with_a_sentence(run_dir: Path) -> None:
    lines = (run_dir / "iterations.jsonl").read_text().splitlines()
    damaged = [line.replace('"admitted":["r0"]', '"admitted":["ghost"]') for line in lines]
    assert damaged != lines
    (run_dir / "iterations.jsonl").write_text("\n".join(damaged) + "\n")
    app = ReplayApp(run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("end")
        await pilot.pause()
    assert app.return_code == 2
    assert app.problem == ("Step 0 refers to request 'ghost', which the run never introduced; "
                           "the recording is incomplete.")


async def test_a_recording_made_while_paused_replays_its_starting_state(tmp_path) -> None:
    live = make_demo_app(tmp_path / "runs")
    async with live.run_test(size=(160, 48)) as pilot:
        advance(live, 40)
        live.engine.post(Pause())
        advance(live, 1)
        await pilot.press("r")
        advance(live, 3)  # paused: no iteration runs
        await pilot.press("r")
        advance(live, 1)
        state = snapshot_of(live.engine).kv.states
    (run,) = (tmp_path / "runs").iterdir()
    app = ReplayApp(run)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("end", "left", "space")
        assert not app.records and app.snapshot.kv.states == state
        assert "no iteration ran while it recorded" in panel_text(app.query_one(Scrubber))
    assert app.problem is None
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "replay", str(run), "--summary",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

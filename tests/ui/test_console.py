"""Pilot tests: knobs through the UI, invalid values, stepping, recording, the live loop."""

from __future__ import annotations

import asyncio

from textual.widgets import Input, OptionList

from kvdeck.console.app import KvdeckApp
from kvdeck.console.screenshots import advance
from kvdeck.console.screenshots import make_demo_app as make_app
from kvdeck.console.widgets.hardware import unified_line
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.runtime.runs.recording import read_run
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.ui.panel_text import panel_text


async def open_editor(pilot, app: KvdeckApp, name: str) -> None:
    """k, move to the knob, Enter: its editor is open."""
    table = app.query_one("#knobs")
    await pilot.press("k")
    table.move_cursor(row=table.get_row_index(name))
    await pilot.press("enter")
    await pilot.pause()


async def edit_knob(pilot, app: KvdeckApp, name: str, text: str) -> None:
    """What an operator does: k, move to the knob, Enter, then choose or type, Enter."""
    await open_editor(pilot, app, name)
    choices = app.screen.query(OptionList)
    if choices:
        options = choices.first()
        options.highlighted = [str(options.get_option_at_index(i).prompt)
                               for i in range(options.option_count)].index(text)
    else:
        app.screen.query_one(Input).value = text
    await pilot.press("enter")
    await pilot.pause()


async def knob_choices(pilot, app: KvdeckApp, name: str) -> list[str]:
    """Open knob `name`'s editor, read the values it offers, and close it again."""
    await open_editor(pilot, app, name)
    options = app.screen.query_one(OptionList)
    offered = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
    await pilot.press("escape")
    return offered


async def test_knob_change_applies_at_next_iteration(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 5)
        await edit_knob(pilot, app, "max_num_batched_tokens", "512")
        assert app.engine.scheduler.knobs.max_num_batched_tokens == 4096  # not yet
        trace: list[dict] = []
        app.engine.recorder = trace.append
        advance(app, 1)
        assert app.engine.scheduler.knobs.max_num_batched_tokens == 512
        assert trace[0].knobs == {"max_num_batched_tokens": 512}
        assert sum(e.num_new_tokens for e in trace[0].plan) <= 512
        await pilot.pause()
        assert str(app.query_one("#knobs").get_cell("max_num_batched_tokens",
                                                    app.query_one("#knobs")._value_col)) == "512"
        # The change is marked in the engine's history, which the charts draw.
        assert any(b.knob_change for b in app.latest.figures.history)


async def test_invalid_knob_notifies_and_changes_nothing(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 3)
        before = app.engine.scheduler.knobs
        await edit_knob(pilot, app, "chunk_size", "-5")
        await edit_knob(pilot, app, "max_num_seqs", "lots")
        await edit_knob(pilot, app, "prefix_cache_capacity", "99999999")
        advance(app, 2)
        assert app.engine.scheduler.knobs == before
        messages = [n.message for n in app._notifications]
        assert "chunk_size must be an integer from 1 to 1,048,576, got -5." in messages
        assert "max_num_seqs must be an integer, got 'lots'." in messages
        blocks = app.engine.kv.num_blocks
        assert (f"prefix_cache_capacity must be from 0 to {blocks:,} (the pool's blocks), got "
                "99,999,999.") in messages


async def test_enum_knobs_offer_their_values_and_changes_show_pending(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 3)
        table = app.query_one("#knobs")
        assert await knob_choices(pilot, app, "queue_policy") == ["fcfs", "priority", "sjf",
                                                                   "edf"]
        await edit_knob(pilot, app, "queue_policy", "sjf")
        app.render_snapshot(snapshot_of(app.engine))  # before the next iteration
        cell = str(table.get_cell("queue_policy", table._value_col))
        assert cell == "fcfs → sjf (next step)"
        advance(app, 1)
        await pilot.pause()
        assert str(table.get_cell("queue_policy", table._value_col)) == "sjf"
        assert app.engine.scheduler.knobs.queue_policy == "sjf"


async def wait_for(pilot, cond, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError("timed out waiting for the console")


async def test_traffic_rate_keys_and_stepping_through_the_inbox(tmp_path) -> None:
    app = make_app(tmp_path / "runs", autostart=True)
    async with app.run_test(size=(160, 48)) as pilot:
        rate = app.traffic.mix.rate_per_s
        await pilot.press("plus")
        assert app.traffic.mix.rate_per_s == rate * 1.5
        await pilot.press("minus")
        assert abs(app.traffic.mix.rate_per_s - rate) < 0.01
        await pilot.press("p")
        await wait_for(pilot, lambda: app.latest is not None and app.latest.paused)
        # The engine thread sets `latest` before the UI renders it (a message later).
        await wait_for(pilot, lambda: "paused" in app.sub_title)
        step = app.latest.step
        await pilot.press("s")
        await pilot.press("s")
        await wait_for(pilot, lambda: app.latest.step == step + 2)
        await pilot.pause(0.3)
        assert app.latest.step == step + 2  # paused: exactly the two steps asked for
        await pilot.press("p")
        await wait_for(pilot, lambda: app.latest.step > step + 2)
        assert not app.latest.paused


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
        advance(app, 1)  # the engine detaches the recorder at its next iteration boundary
        assert app.recorder is None and app.engine.recorder is None
    (run,) = (tmp_path / "runs").iterdir()
    header, records = read_run(run)
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
        await wait_for(pilot, lambda: app.latest.paused)
        await pilot.press("q")
    assert not app.loop.is_alive and app.loop.error is None
    app.engine.check_integrity()


KNOB_VALUES = {
    "max_num_batched_tokens": ("1024", 1024), "max_num_seqs": ("8", 8),
    "chunk_size": ("64", 64), "scheduling": ("static", "static"),
    "queue_policy": ("sjf", "sjf"), "sjf_max_wait_s": ("5", 5.0),
    "reservation": ("full", "full"), "preemption": ("recompute", "recompute"),
    "enable_prefix_caching": ("false", False), "prefix_cache_capacity": ("100", 100),
    "prefix_wait": ("false", False),
    "eviction_policy": ("value", "value"), "admission_control": ("true", True),
    "on_deadline_miss": ("wait", "wait"), "kv_format": ("q8_0", "q8_0"),
    "weight_format": ("int8", "int8"), "demote_prefixes": ("false", False),
    "offload_layers": ("4", 4), "offload_buffers": ("1", 1),
    "speculative_method": ("ngram", "ngram"), "num_speculative_tokens": ("6", 6),
    "prompt_lookup_max": ("2", 2), "draft_length": ("fixed", "fixed"),
    "itl_target_ms": ("50", 50.0), "priority_max_wait_s": ("10", 10.0),
    "cache_admission_k": ("2", 2), "cache_admission_window": ("64", 64),
}


def test_every_engine_knob_is_listed() -> None:
    import dataclasses

    from kvdeck.runtime.core.config import Knobs

    assert set(KNOB_VALUES) == {f.name for f in dataclasses.fields(Knobs)}


async def test_every_knob_applies_at_the_next_iteration(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)):
        advance(app, 3)
        for name, (text, value) in KNOB_VALUES.items():
            assert app.apply_knob(name, text), name
            advance(app, 1)
            assert getattr(app.engine.scheduler.knobs, name) == value, name
        assert app.apply_knob("traffic_long_fraction", "0.9")
        assert app.traffic.mix.long_fraction == 0.9


async def test_prompt_streams_tokens_and_highlights_its_blocks(app: KvdeckApp) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 5)
        await pilot.press("slash")
        app.query_one("#prompt-input", Input).value = "What is paged attention?" * 4
        await pilot.press("enter")
        rid = app.prompt_id
        assert rid is not None and app.query_one(KVMapPanel).selected == rid
        seen = []
        for _ in range(100):
            advance(app, 1)
            (t,) = [t for t in app.latest.tracked if t.request_id == rid]
            seen.append(t.num_output_tokens)
            if t.status.startswith("finished"):
                break
        assert seen[-1] == 48 and len(set(seen)) > 10  # tokens arrived step by step
        out = str(app.query_one("#prompt-output").render())
        assert f"{rid} [finished_length, 48 tokens]" in out
        assert len(t.text.split()) == 48  # the stand-in tokenizer: one word per token
        await pilot.press("slash")  # sending left the input; / comes back to it
        app.query_one("#prompt-input", Input).value = "   "
        await pilot.press("enter")  # an empty prompt is refused with a notice
        assert any("Type a prompt first." == n.message for n in app._notifications)


async def test_keys_respond_with_1000_running_requests(tmp_path) -> None:
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.executors.sim import SimExecutor

    engine = Engine(EngineConfig(num_blocks=80_000, knobs=Knobs(
        max_num_seqs=1024, max_num_batched_tokens=16384)), SimExecutor())
    for i in range(1000):
        engine.add_request([3 + i % 1000] * 40, SamplingParams(max_tokens=5000,
                                                               ignore_eos=True))
    app = KvdeckApp(engine, autostart=True, hardware=False, runs_dir=tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(400):
            await asyncio.sleep(0.05)
            if app.latest is not None and len(app.latest.running) == 1000:
                break
        assert len(app.latest.running) == 1000
        await pilot.press("p")
        await wait_for(pilot, lambda: app.latest.paused)
        await pilot.press("n")
        assert app.query_one(KVMapPanel).selected is not None
        await pilot.press("p", "q")
    assert app.loop.error is None


async def test_prefix_tree_collapse_survives_new_snapshots(app: KvdeckApp) -> None:
    from kvdeck.console.widgets.prefix_tree import PrefixTreePanel

    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 40)
        tree = app.query_one(PrefixTreePanel)
        shared = next(n for n in tree.root.children if n.children)  # the system prompt
        shared.collapse()
        await pilot.pause()
        assert shared.data in tree.collapsed_ids
        advance(app, 5)
        again = next(n for n in tree.root.children if n.data == shared.data)
        assert not again.is_expanded and again.children


async def test_engine_failure_shows_a_banner_and_q_quits(tmp_path, monkeypatch) -> None:
    from kvdeck.console.widgets.banner import Banner

    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    app = make_app(tmp_path / "runs", autostart=True, fail_at_step=8)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.latest is not None and app.latest.failure)
        await pilot.pause()
        banner = app.query_one(Banner)
        text = str(banner.render())
        assert banner.has_class("-failed") and banner.display
        assert "The engine stopped: RuntimeError: injected failure at step 8" in text
        (log,) = (tmp_path / "logs").glob("failure-*.log")
        assert str(log) in text.replace("\n", "")
        assert "failed" in app.sub_title and not app.loop.is_alive
        await pilot.press("q")
    assert app.loop.error is not None and not app.engine.kv.tables


async def test_w_saves_the_settings_with_the_knobs_as_they_are(tmp_path) -> None:
    from kvdeck.runtime.settings import load

    app = make_app(tmp_path / "runs")
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 2)
        assert app.apply_knob("max_num_seqs", "48")
        advance(app, 1)
        await pilot.press("w")
    (saved,) = (tmp_path / "runs").glob("settings-*.toml")
    settings = load(saved)  # what `kvdeck serve --config` / `run-trace --config` read
    assert settings.engine.knobs == app.engine.scheduler.knobs
    assert settings.engine.knobs.max_num_seqs == 48
    assert settings.engine.kv_memory_bytes == app.engine.config.kv_memory_bytes
    assert settings.executor == "sim"


async def test_request_table_filters_sorts_details_aborts_and_reprioritizes(app) -> None:
    from textual.widgets import DataTable

    from kvdeck.console.screens.requests import RequestsScreen

    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 300)  # long enough for the first requests to finish
        await pilot.press("l")
        screen = app.screen
        assert isinstance(screen, RequestsScreen)
        table = screen.query_one(DataTable)
        snap = app.latest
        total = len(snap.running) + len(snap.waiting) + len(snap.finished)
        assert table.row_count == total and snap.waiting  # all requests, not just a screen
        await pilot.press("f")  # running only
        assert screen.filter == "running" and table.row_count == len(snap.running)
        await pilot.press("f", "f")  # finished
        assert table.row_count == len(snap.finished) > 0
        await pilot.press("f")  # back to all
        await pilot.press("o", "o")  # sort by prompt size, largest first
        prompts = [screen.views[rid].prompt_tokens for rid in screen.shown_ids]
        assert prompts == sorted(prompts, reverse=True)
        # The story of a running request, and its blocks highlighted in the KV map.
        await pilot.press("f")
        rid = screen.shown_ids[0]
        await pilot.press("enter")
        await pilot.pause()  # the table's RowSelected message is handled after the key
        advance(app, 1)
        await pilot.pause()
        detail = str(screen.query_one("#request-detail").render())
        assert rid in detail and "arrived" in detail and "admitted" in detail
        assert "prefill tokens " in detail and "first token" in detail and "blocks (" in detail
        assert app.screen_stack[0].query_one(KVMapPanel).selected == rid
        # Priority, then abort, from the table.
        before = screen.views[rid].priority
        await pilot.press("minus")
        advance(app, 1)
        await pilot.pause()
        assert app.latest.detail.priority == before + 1
        await pilot.press("a")
        advance(app, 1)
        await pilot.pause()
        assert app.latest.detail.status == "aborted"
        assert "aborted by the operator" in str(screen.query_one("#request-detail").render())
        await pilot.press("escape")
        assert not isinstance(app.screen, RequestsScreen)
        app.engine.check_integrity()


async def test_queue_panel_says_why_requests_wait(app) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        assert app.apply_knob("max_num_seqs", "4")
        advance(app, 30)
        await pilot.pause()
        text = panel_text(app.query_one("#queue"))
        assert "waiting: sequence limit (max_num_seqs) reached" in text


async def test_charts_show_rates_step_time_and_kv_with_knob_marks(app) -> None:
    async with app.run_test(size=(120, 40)) as pilot:
        advance(app, 150)
        assert app.apply_knob("chunk_size", "512")
        advance(app, 150)
        await pilot.press("c")
        text = panel_text(app.screen.query_one("#charts"))
        for title in ("requests/s arriving", "prompt tokens/s computed", "generation tokens/s",
                      "step time, ms", "KV usage"):
            assert title in text
        assert text.count("▲") >= 5  # the knob change, on every chart's axis
        assert "0:00" in text and "┤" in text  # time and value axes
        steps_before = app.latest.step
        advance(app, 30)  # the open charts follow new snapshots
        assert app.latest.step > steps_before
        assert panel_text(app.screen.query_one("#charts")) != text
        metrics = panel_text(app.screen_stack[0].query_one("#metrics"))
        assert "in " in metrics and "tok/s" in metrics  # arrivals and generation rates
        await pilot.press("escape")
        assert app.screen is app.screen_stack[0]


async def test_hardware_strip_shows_kvdeck_cpu_and_memory(tmp_path) -> None:
    app = make_app(tmp_path / "runs")
    app.hardware = True  # the demo app turns readings off for deterministic snapshots
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        app.query_one("#hardware").refresh_readings()
        text = panel_text(app.query_one("#hardware"))
        assert "kvdeck CPU" in text and "RSS" in text and "machine CPU" in text
        # What Apple silicon shows instead of NVML: the engine's weights and KV pool
        # against the one memory CPU and GPU share (the sim's card: 16 GB of weights).
        weights, kv = app._resident_bytes()
        assert kv == app.latest.kv.num_blocks * app.latest.kv.bytes_per_block > 0
        assert weights == app.latest.weights.resident_bytes > 0
        line = unified_line(weights, kv, 96 * 2**30)
        assert line.startswith(f"unified memory: weights {weights / 2**30:.2f} + KV ")
        assert line.endswith(f"of 96 GiB ({100 * (weights + kv) / (96 * 2**30):.1f}%)")


async def test_escape_leaves_the_prompt_and_the_answer_wraps_and_scrolls(app) -> None:
    from textual.widgets import Footer

    async with app.run_test(size=(100, 30)) as pilot:
        advance(app, 3)
        await pilot.press("slash", "p", "k", "q")  # typing: the keys go into the prompt
        prompt = app.query_one("#prompt-input", Input)
        assert prompt.value == "pkq" and app.focused is prompt and not app.want_paused
        await pilot.pause()
        footer_keys = {k.description for k in app.query_one(Footer).query("FooterKey")}
        assert "Leave prompt" in footer_keys  # the footer says how to leave
        await pilot.press("escape")
        assert app.focused is not prompt
        await pilot.press("p")  # the console's keys work again
        assert app.want_paused
        await pilot.press("p")
        await pilot.press("slash")
        prompt.value = "Explain continuous batching in detail " * 3
        await pilot.press("enter")
        assert app.focused is not prompt  # sending leaves the input too
        for _ in range(200):
            advance(app, 1)
            await pilot.pause()
            (t,) = [t for t in app.latest.tracked if t.request_id == app.prompt_id]
            if t.status.startswith("finished"):
                break
        out = panel_text(app.query_one("#prompt-output"))
        assert len(out.strip().splitlines()) > 2  # 48 words wrap over several lines
        await pilot.resize_terminal(50, 30)  # too narrow for the answer in 6 lines: it scrolls
        await pilot.pause()
        app.render_snapshot(app.latest)
        await pilot.pause()
        scroll = app.query_one("#prompt-scroll")
        assert scroll.max_scroll_y > 0 and scroll.scroll_y == scroll.max_scroll_y  # newest in view


async def test_80x24_shows_knob_values_queue_essentials_and_the_keys_that_matter(app) -> None:
    from textual.widgets import Footer

    async with app.run_test(size=(80, 24)) as pilot:
        advance(app, 120)
        await pilot.pause()
        knobs = app.query_one("#knobs")
        lines = [knobs.render_line(y).text for y in range(knobs.size.height)]
        snap = app.latest
        shown = {"max_num_seqs": str(snap.knobs.max_num_seqs),
                 "chunk_size": str(snap.knobs.chunk_size),
                 "scheduling": snap.knobs.scheduling}
        for name, value in shown.items():  # each visible knob row ends in its whole value
            row = next(line for line in lines
                       if line.split() and name.startswith(line.split()[0].rstrip("…")))
            assert value in row.split(), (name, row)
        queue = panel_text(app.query_one("#queue")).splitlines()
        header = next(line for line in queue if line.split()[:1] == ["id"])
        assert header.split() == ["id", "state", "prompt", "out"]  # nothing cut
        first = snap.running[0]
        assert any(line.split()[:2] == [first.request_id[-8:], "run"] for line in queue)
        visible = {k.description for k in app.query_one(Footer).query("FooterKey")
                   if k.region.right <= 80 and k.region.width}
        assert {"Quit", "Pause", "Knobs", "Requests", "Record", "Prompt", "Charts", "Help",
                "Theme"} <= visible


async def test_metrics_panel_counts_answers_that_passed_their_checks(app) -> None:
    """Requests with checks among the traffic: the panel says how many answers passed, and
    goodput leaves out the wrong ones."""
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.text.checks import parse_check

    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 5)
        await pilot.pause()
        assert "correct" not in panel_text(app.query_one("#metrics"))
        words = parse_check({"regex": r"\s*[a-z]+( [a-z]+)*\s*"})  # the stand-in's answers
        wrong = parse_check({"expected": "Paris"})
        reqs = [app.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), check=c)
                for c in (words, wrong, wrong)]
        while not all(r.status.is_finished for r in reqs):
            advance(app, 5)
        await pilot.pause()
        text = panel_text(app.query_one("#metrics"))
        # The panel's narrow forms at this size; only the three checked requests are done.
        assert "correct 1/3" in text and "good 33%" in text


async def test_prompt_options_send_several_samples_that_share_the_prompt(app) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 3)
        await pilot.press("slash")
        app.query_one("#prompt-input", Input).value = \
            "n=3 temp=0.9 seed=4 " + "What is paged attention? " * 6
        await pilot.press("enter")
        rid = app.prompt_id
        shared_seen = False
        for _ in range(100):
            advance(app, 1)
            (t,) = [t for t in app.latest.tracked if t.request_id == rid]
            tables = {r.request_id: r.block_table for r in app.latest.running}
            mine = [tables[i] for i in (rid, f"{rid}.1", f"{rid}.2") if i in tables]
            if len(mine) == 3:  # the three samples hold the prompt's first block once
                shared_seen |= mine[0][0] == mine[1][0] == mine[2][0]
            if t.status.startswith("finished") and all(
                    b.status.startswith("finished") for b in t.branches):
                break
        assert shared_seen and len(t.branches) == 2
        out = str(app.query_one("#prompt-output").render())
        assert "sample 2 [finished_length, 48 tokens]" in out and "sample 3 [" in out
        assert len({t.text, *(b.text for b in t.branches)}) == 3  # seeded, and different
        for bad, sentence in [("n=x hi", "n= must be a whole number from 1 to 64"),
                              ("regex=\\d+ hi", "needs a model executor")]:
            await pilot.press("slash")
            app.query_one("#prompt-input", Input).value = bad
            await pilot.press("enter")
            assert any(sentence in n.message for n in app._notifications), bad

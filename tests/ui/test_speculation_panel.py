"""The speculation panel, live on the sim with n-gram speculation, and the same panel drawn
from a recording of it."""

from __future__ import annotations

from kvdeck.console.screenshots import advance, make_demo_app
from kvdeck.console.widgets.speculation import SpeculationPanel
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.ui.panel_text import panel_text
from tests.ui.test_replay import record_live, replay_equals_live

SETTINGS = {"speculative_method": "ngram", "num_speculative_tokens": 3,
            "spec_acceptance": 0.6}


async def test_acceptance_shows_live_per_position(tmp_path) -> None:
    app = make_demo_app(tmp_path / "runs", **SETTINGS)
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 80)
        await pilot.pause()
        v = snapshot_of(app.engine).speculation
        assert v.drafts > 0 and 0 < v.accepted_tokens < v.draft_tokens
        text = " ".join(panel_text(app.query_one(SpeculationPanel)).split())
        assert f"{v.drafts:,} drafts · {v.draft_tokens:,} draft tokens" in text
        assert f"accepted {v.accepted_tokens:,} ({v.acceptance_rate:.0%})" in text
        assert f"{v.mean_accepted_length:.2f} tokens per verify pass" in text
        assert "ngram, k = 3" in text
        for i, rate in enumerate(v.per_position):
            assert f"pos {i + 1} " in text and f"{rate:.0%}" in text
        counts = v.accepted_per_pos  # a later position is kept only if all before were
        assert all(a >= b for a, b in zip(counts, counts[1:], strict=False))


async def test_off_says_how_to_turn_it_on(tmp_path) -> None:
    app = make_demo_app(tmp_path / "runs")
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 3)
        await pilot.pause()
        text = " ".join(panel_text(app.query_one(SpeculationPanel)).split())
        assert "Speculative decoding is off" in text and "--speculative-method ngram" in text


async def test_a_recording_with_speculation_replays_panel_for_panel(tmp_path) -> None:
    live = make_demo_app(tmp_path / "runs", **SETTINGS)
    shown = await record_live(live, steps_before=60, steps=40)
    assert all(s.speculation.drafts for s in shown.values())
    (run,) = (tmp_path / "runs").iterdir()
    await replay_equals_live(run, shown)


DRAFT = {"speculative_method": "draft", "num_speculative_tokens": 3,
         "spec_acceptance_profile": "0.9,0.7,0.5", "draft_cost": 0.1, "draft_kv_ratio": 0.25}


async def test_a_draft_model_shows_in_the_panel_and_the_kv_map(tmp_path) -> None:
    from kvdeck.console.widgets.kv_map import KVMapPanel

    app = make_demo_app(tmp_path / "runs", **DRAFT)
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 80)
        await pilot.pause()
        snap = snapshot_of(app.engine)
        v = snap.speculation
        assert v.drafts > 0 and v.draft_seconds > 0
        text = " ".join(panel_text(app.query_one(SpeculationPanel)).split())
        assert "draft, k = 3" in text
        assert "draft model: modelled, 0.1× target, sequential" in text
        share = v.draft_seconds / v.step_seconds
        assert f"drafting: {share:.0%} of step time" in text
        kv = " ".join(panel_text(app.query_one(KVMapPanel)).split())
        # Qwen3-8B: 144 KiB of KV per token; the modelled draft's twin is a quarter of it.
        assert snap.kv.draft_bytes_per_block == snap.kv.bytes_per_block // 4
        assert "each block + draft twin:" in kv and "(20% for the draft)" in kv


async def test_a_recording_with_a_draft_model_replays_panel_for_panel(tmp_path) -> None:
    live = make_demo_app(tmp_path / "runs", **DRAFT)
    shown = await record_live(live, steps_before=60, steps=30)
    assert all(s.speculation.draft_seconds for s in shown.values())
    (run,) = (tmp_path / "runs").iterdir()
    await replay_equals_live(run, shown)

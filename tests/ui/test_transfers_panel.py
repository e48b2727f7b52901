"""The transfers panel and the KV map's host row, live on the sim with a host tier, swap
preemption and weight offload — and the same panels, drawn from a recording of it."""

from __future__ import annotations

from kvdeck.console.screenshots import advance, make_demo_app
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.console.widgets.prefix_tree import PrefixTreePanel
from kvdeck.console.widgets.transfers import TransfersPanel
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.ui.panel_text import panel_text, tree_text
from tests.ui.test_replay import record_live, replay_equals_live

GIB = 1 << 30
SETTINGS = {"kv_memory_bytes": GIB, "host_kv_memory_bytes": 2 * GIB, "preemption": "swap",
            "offload_layers": 8}


async def test_swaps_demotions_and_offload_copies_show_as_they_happen(tmp_path) -> None:
    app = make_demo_app(tmp_path / "runs", **SETTINGS)
    e = app.engine
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(3000):
            advance(app, 1)
            c = snapshot_of(e).transfers.counters
            if c["swap_outs"] and c["demotions"] and e.kv.host_tables:
                break
        else:
            raise AssertionError("no swap and demotion under this load")
        await pilot.pause()
        text = " ".join(panel_text(app.query_one(TransfersPanel)).split())  # unwrapped
        t = snapshot_of(e).transfers
        assert f"host {t.host_swapped + t.host_demoted:,}/{t.host_blocks:,} blk" in text
        assert f"▓ {t.host_swapped:,} swapped ░ {t.host_demoted:,} demoted" in text
        assert f"swaps {t.counters['swap_outs']:,} out {t.counters['swap_ins']:,} in" in text
        assert "on host: " + next(iter(e.kv.host_tables)) in text
        assert f"prefix {t.counters['demotions']:,} demoted" in text
        # Qwen3-8B's FFN layer is 288 MiB (its own group shares, not an assumed 65 %).
        assert "offload layers 28–35 FFN 2,304 MiB per step 2 buffers × 288 MiB" in text
        assert f"step {t.last.step}:" in text
        assert "weights→dev ×8" in text  # the latest step's prefetches, as they happened
        assert "link 64 GB/s (profile)" in text and "mode: swap, demotion on" in text
        kv_map = panel_text(app.query_one(KVMapPanel))
        assert f"▓ swapped {t.host_swapped}" in kv_map and f"░ demoted {t.host_demoted}" in kv_map
        host_row = kv_map.split("\nhost ")[-1]
        assert "▓" in host_row  # swapped blocks drawn on the host row (they outrank demoted)
        # Demoted prefix segments are marked in the prefix tree.
        if any(n.on_host for n in snapshot_of(e).prefix_nodes):
            assert "on host (demoted)" in tree_text(app.query_one(PrefixTreePanel))


async def test_nothing_configured_says_so(tmp_path) -> None:
    app = make_demo_app(tmp_path / "runs")
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 5)
        await pilot.pause()
        text = " ".join(panel_text(app.query_one(TransfersPanel)).split())
        assert "No host KV tier (--host-kv-memory-gib) and no weight offload" in text


async def test_a_recording_with_transfers_replays_panel_for_panel(tmp_path) -> None:
    live = make_demo_app(tmp_path / "runs", **SETTINGS)
    shown = await record_live(live, steps_before=300, steps=60)
    assert any(s.transfers.counters["swap_outs"] for s in shown.values())
    (run,) = (tmp_path / "runs").iterdir()
    await replay_equals_live(run, shown)

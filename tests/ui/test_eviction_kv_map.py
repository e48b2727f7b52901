"""The KV map under token-level eviction, on a tiny random-weight Gemma 3 with the torch
executor: the policy and the blocks evicted so far, the highlighted request's evicted
token ranges, and a KV format switch mid-run that re-lays the pool around the holes."""

from __future__ import annotations

from kvdeck.console.app import KvdeckApp
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from tests.ui.panel_text import panel_text
from tests.ui.test_console import edit_knob
from tests.ui.test_window_kv_map import advance


async def test_kv_map_shows_what_was_evicted(tiny_gemma3, tmp_path):
    settings = resolve({"executor": "torch", "model": str(tiny_gemma3), "device": "cpu",
                        "dtype": "fp32", "kv_format": "fp16", "block_size": 4,
                        "num_blocks": 24, "kv_eviction": "sink-window",
                        "kv_sink_tokens": 4, "kv_recent_tokens": 16,
                        "max_num_batched_tokens": 8, "chunk_size": 8,
                        "weight_format": "dense"})
    session = build_session(settings, live=False, with_tokenizer=False)
    app = KvdeckApp(session.engine, autostart=False, hardware=False,
                    runs_dir=tmp_path / "runs", settings=settings)
    e = app.engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    req = e.add_request([5 + (7 * j) % 80 for j in range(120)], sp, request_id="long")
    async with app.run_test(size=(160, 48)) as pilot:
        panel = app.query_one(KVMapPanel)
        panel.selected = "long"
        advance(app, 10)  # 80 tokens in: 4..63 evicted (the sink and 64..79 kept)
        await pilot.pause()
        text = " ".join(panel_text(panel).split())
        assert "eviction sink-window: 4 sink + 16 recent tokens kept · 15 blocks evicted" \
            in text
        assert "highlighted: long · evicted tokens 4–63" in text
        # A KV format switch re-lays the blocks left; the holes stay holes.
        await edit_knob(pilot, app, "kv_format", "fp32")
        advance(app, 2)
        assert e.switcher.kv_format == "fp32" and -1 in e.kv.table("long")
        advance(app, 40)
        assert req.status is RequestStatus.FINISHED_LENGTH
        e.check_integrity()
        assert e.kv.pool.num_held == 0

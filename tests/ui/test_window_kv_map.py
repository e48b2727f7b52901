"""The KV map under `free_window_kv`, on a tiny random-weight Gemma 3 (window 8) with the
torch executor: pages of both layer groups drawn apart and counted, and a KV format switch
mid-run that re-lays both groups' pages without losing anyone."""

from __future__ import annotations

from kvdeck.console.app import KvdeckApp
from kvdeck.console.widgets.kv_map import WINDOW_CHAR, KVMapPanel
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.ui.panel_text import panel_text
from tests.ui.test_console import edit_knob


def advance(app: KvdeckApp, steps: int) -> None:
    for _ in range(steps):
        app.engine.step()
        app.engine.check_integrity()
    app.render_snapshot(snapshot_of(app.engine))


async def test_kv_map_shows_both_groups(tiny_gemma3, tmp_path):
    settings = resolve({"executor": "torch", "model": str(tiny_gemma3), "device": "cpu",
                        "dtype": "fp32", "kv_format": "fp16", "block_size": 4,
                        "num_blocks": 300, "free_window_kv": True,
                        "max_num_batched_tokens": 64, "chunk_size": 16,
                        "weight_format": "dense"})
    session = build_session(settings, live=False, with_tokenizer=False)
    app = KvdeckApp(session.engine, autostart=False, hardware=False,
                    runs_dir=tmp_path / "runs", settings=settings)
    e = app.engine
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [e.add_request([5 + (j * 7 + i) % 80 for j in range(40)], sp, request_id=f"r{i}")
            for i in range(3)]
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 6)
        await pilot.pause()
        panel = app.query_one(KVMapPanel)
        text = panel_text(panel)
        full, window = e.kv.window_counts()
        assert window > 0 and full > 0
        assert f"█ full-attention {full} pages · {WINDOW_CHAR} window {window} pages" in text
        assert "1 full-attention and 6 sliding-window layers (window 8)" in " ".join(text.split())
        assert WINDOW_CHAR in panel.grid.plain and "█" in panel.grid.plain
        assert str(panel.border_subtitle).startswith("300 pages × 4 tok · fp16")
        # A KV format switch re-lays every page of both groups; decoding goes on.
        await edit_knob(pilot, app, "kv_format", "fp32")
        advance(app, 2)
        await pilot.pause()
        assert e.switcher.kv_format == "fp32" and e.executor.kv.codec.name == "fp32"
        assert e.executor.kv.num_layers == 1 and e.executor.kv.num_blocks == 300  # pages
        assert all(r.status is RequestStatus.RUNNING for r in reqs)
        advance(app, 40)
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
        e.check_integrity()
        assert e.kv.pool.num_held == 0

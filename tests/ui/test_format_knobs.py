"""Switching the KV format and the weight format through the console's knobs, on a real
(tiny, random-weight) GGUF model with the torch executor, while requests decode over a
cached shared prefix: nobody is lost, the pool stays consistent, and the KV map's capacity
moves by the formats' byte ratio."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.console.app import KvdeckApp
from kvdeck.console.widgets.kv_map import KVMapPanel
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.factories import TinySpec, write_tiny_gguf
from tests.ui.panel_text import panel_text
from tests.ui.test_console import edit_knob, knob_choices

SPEC = TinySpec(arch="llama", head_dim=32, num_heads=2, num_kv_heads=1, hidden=64, ffn=128)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama-hd32.gguf", SPEC)


def advance(app: KvdeckApp, steps: int) -> None:
    """Step the engine on the test's thread (no traffic here), then draw."""
    for _ in range(steps):
        app.engine.step()
    app.render_snapshot(snapshot_of(app.engine))


def make_app(model: Path, tmp_path: Path) -> KvdeckApp:
    # 96 blocks of 4 tokens at fp16; 2 layers × 1 KV head × 32 values × 2 (K, V).
    fp16_bytes_per_block = 4 * 2 * 2 * 32 * 2
    settings = resolve({"executor": "torch", "model": str(model), "device": "cpu",
                        "dtype": "fp32", "kv_format": "fp16", "block_size": 4,
                        "kv_memory_bytes": 96 * fp16_bytes_per_block,
                        "max_num_batched_tokens": 64, "chunk_size": 16,
                        "weight_format": "dense"})
    session = build_session(settings, live=False, with_tokenizer=False)
    app = KvdeckApp(session.engine, autostart=False, hardware=False,
                    runs_dir=tmp_path / "runs", settings=settings)
    app.NOTIFICATION_TIMEOUT = 3600  # read afterwards, however slow the machine
    return app


async def test_kv_and_weight_formats_switch_through_the_knobs_mid_run(tiny32, tmp_path):
    app = make_app(tiny32, tmp_path)
    e = app.engine
    prefix = [7 + j % 50 for j in range(24)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reqs = [e.add_request(prefix + [60 + i, 61 + i], sp, request_id=f"r{i}") for i in range(4)]
    async with app.run_test(size=(160, 48)) as pilot:
        advance(app, 6)
        running = [r for r in e.scheduler.running if r.num_output_tokens > 0]
        assert len(running) == 4 and e.kv.tree.num_nodes >= 6  # decoding over a cached prefix
        assert e.kv.num_blocks == 96
        # The KV format knob offers what this executor can store, then applies next step.
        table = app.query_one("#knobs")
        offered = await knob_choices(pilot, app, "kv_format")
        assert {"fp32", "fp16", "bf16", "q8_0", "q4_0"} <= set(offered)
        await edit_knob(pilot, app, "kv_format", "q8_0")
        advance(app, 1)
        await pilot.pause()
        e.check_integrity()
        # fp16 stores 64 bytes per 32 values, q8_0 34: the pool buys 64/34 as many blocks.
        assert e.kv.num_blocks == 96 * 64 // 34 == 180
        assert e.switcher.kv_format == "q8_0" and e.executor.kv.codec.name == "q8_0"
        kv_map = panel_text(app.query_one(KVMapPanel))
        assert "kv_format fp16 → q8_0" in kv_map and "pool 180" in kv_map
        assert "180 × 4 tok · q8_0" in str(app.query_one(KVMapPanel).border_subtitle)
        assert all(r.status is RequestStatus.RUNNING for r in reqs)
        assert e.kv.tree.num_nodes >= 6  # the cached prefix was converted, not dropped
        # The weight format is typed (all groups, or per group).
        await edit_knob(pilot, app, "weight_format", "attn=int8,ffn=int4,head=bf16")
        advance(app, 1)
        await pilot.pause()
        e.check_integrity()
        assert e.executor.weight_formats == {"attn": "int8", "ffn": "int4", "head": "bf16"}
        sw = e.switcher.recent[-1]
        assert sw.knob == "weight_format" and sw.bytes < sw.bytes_before
        assert "weights" in str(table.border_subtitle)
        assert "weights re-packed at step" in str(table.border_title)  # pause and bytes stay
        assert all(r.status is RequestStatus.RUNNING for r in reqs)
        # Back to a smaller pool (fp32: 32 bytes a value): requests still fit, nobody lost.
        await edit_knob(pilot, app, "kv_format", "fp32")
        advance(app, 1)
        e.check_integrity()
        assert e.kv.num_blocks == 48
        for _ in range(200):
            if not e.has_work:
                break
            advance(app, 1)
        e.check_integrity()
        assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 40
                   for r in reqs)
        notes = [n.message for n in app._notifications]
        assert any(m.startswith("kv_format fp16 → q8_0") for m in notes)
        assert any(m.startswith("weight_format dense → attn=int8") for m in notes)

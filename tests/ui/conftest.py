"""A console app on the sim executor with a fixed seed, stepped by the test (no thread)."""

from __future__ import annotations

import pytest

from console.app import KvdeckApp
from runtime.config import EngineConfig, Knobs
from runtime.engine import Engine
from runtime.executors.sim import SimConfig, SimExecutor
from runtime.traffic import TrafficGenerator, TrafficMix


def make_app(tmp_path=None, autostart: bool = False) -> KvdeckApp:
    engine = Engine(EngineConfig(kv_memory_bytes=4 << 30, seed=3,
                                 knobs=Knobs(max_num_batched_tokens=4096, chunk_size=1024)),
                    SimExecutor(SimConfig(), seed=3))
    mix = TrafficMix.for_context(32768, rate_per_s=6.0)
    traffic = TrafficGenerator(engine, mix, vocab_size=32_000, seed=3)
    kwargs = {"runs_dir": tmp_path / "runs"} if tmp_path is not None else {}
    return KvdeckApp(engine, traffic, autostart=autostart, hardware=False, **kwargs)


def advance(app: KvdeckApp, steps: int) -> None:
    """Run `steps` iterations with traffic on the test's thread, then render."""
    for _ in range(steps):
        app.traffic(app.engine)
        app.engine.step()
        app.engine.check_integrity()
    app.render_snapshot(app.engine.snapshot())


@pytest.fixture()
def app(tmp_path) -> KvdeckApp:
    return make_app(tmp_path)

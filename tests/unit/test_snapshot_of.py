"""Snapshots are built from outside the engine (`views/snapshot.snapshot_of`): one builder
per engine, which neither keeps the engine alive nor writes into it."""

from __future__ import annotations

import gc
import weakref

from kvdeck.runtime.core.commands import Watch
from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.sim import SimExecutor
from kvdeck.runtime.views.snapshot import snapshot_builder, snapshot_of


def engine() -> Engine:
    return Engine(EngineConfig(num_blocks=64, block_size=16), SimExecutor())


def test_one_builder_per_engine_and_none_keeps_an_engine_alive() -> None:
    e = engine()
    assert snapshot_builder(e) is snapshot_builder(e)
    assert snapshot_builder(e) is not snapshot_builder(engine())
    snapshot_of(e)
    gone = weakref.ref(e)
    e.close()
    del e
    gc.collect()
    assert gone() is None  # a builder holding its engine would keep every model in memory


def test_a_request_watched_before_it_arrives_shows_once_it_does() -> None:
    e = engine()
    e.post(Watch("later"))
    e.step()
    assert snapshot_of(e).detail is None
    e.add_request(list(range(1, 20)), SamplingParams(max_tokens=3), request_id="later")
    e.step()
    detail = snapshot_of(e).detail
    assert detail is not None and detail.request_id == "later"
    e.close()

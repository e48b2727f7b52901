"""The engine in its own thread: submissions, aborts and knob changes from other threads."""

from __future__ import annotations

import threading
import time

from runtime.config import EngineConfig, Knobs
from runtime.engine import Engine
from runtime.engine_loop import EngineLoop
from runtime.executors.sim import SimExecutor
from runtime.request import RequestStatus, SamplingParams


def wait_until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting for the engine thread"
        time.sleep(0.01)


def test_concurrent_clients_aborts_and_knobs() -> None:
    engine = Engine(EngineConfig(block_size=8, num_blocks=400,
                                 knobs=Knobs(max_num_seqs=32)), SimExecutor())
    snapshots = []
    loop = EngineLoop(engine, on_snapshot=snapshots.append, snapshot_interval_s=0.01,
                      pace=2.0).start()
    ids: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(10):
            r = engine.add_request([c + 3] * (20 + i), SamplingParams(max_tokens=30),
                                   request_id=f"c{c}-{i}")
            with lock:
                ids.append(r.request_id)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.abort("c0-9")
    engine.set_knobs(max_num_seqs=8)
    wait_until(lambda: len(engine.completed) == 40)
    loop.stop()
    assert not loop.is_alive and loop.error is None
    engine.check_integrity()
    assert sorted(r.request_id for r in engine.completed) == sorted(ids)
    by_id = {r.request_id: r for r in engine.completed}
    assert by_id["c0-9"].status in (RequestStatus.ABORTED, RequestStatus.FINISHED_LENGTH)
    assert engine.scheduler.knobs.max_num_seqs == 8
    assert snapshots and snapshots[-1].num_finished + snapshots[-1].num_aborted == 40
    assert not engine.kv.tables


def test_pause_and_step_once() -> None:
    engine = Engine(EngineConfig(block_size=8, num_blocks=64), SimExecutor())
    loop = EngineLoop(engine).start()
    loop.pause()
    time.sleep(0.1)
    engine.add_request([5] * 10, SamplingParams(max_tokens=5))
    time.sleep(0.2)
    assert engine.step_count == 0
    loop.step_once()
    wait_until(lambda: engine.step_count == 1)
    time.sleep(0.1)
    assert engine.step_count == 1
    loop.resume()
    wait_until(lambda: len(engine.completed) == 1)
    loop.stop()
    engine.check_integrity()

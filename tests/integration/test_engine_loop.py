"""The engine in its own thread: submissions, aborts and knob changes from other threads."""

from __future__ import annotations

import threading
import time

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.executors.sim import SimExecutor
from kvdeck.runtime.runs.loop import EngineLoop


def wait_until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting for the engine thread"
        time.sleep(0.01)


def test_concurrent_clients_aborts_and_knobs() -> None:
    engine = Engine(EngineConfig(block_size=8, num_blocks=400,
                                 knobs=Knobs(max_num_seqs=32)), SimExecutor(), pace=2.0)
    snapshots = []
    loop = EngineLoop(engine, on_snapshot=snapshots.append, snapshot_interval_s=0.01).start()
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


def test_pause_and_step_once_go_through_the_inbox() -> None:
    engine = Engine(EngineConfig(block_size=8, num_blocks=64), SimExecutor(), pace=1.0)
    snapshots = []
    loop = EngineLoop(engine, on_snapshot=snapshots.append).start()
    loop.pause()
    wait_until(lambda: snapshots and snapshots[-1].paused)
    req = engine.add_request([5] * 10, SamplingParams(max_tokens=5))
    time.sleep(0.3)
    assert engine.step_count == 0
    loop.step_once()
    wait_until(lambda: engine.step_count == 1)
    time.sleep(0.1)
    assert engine.step_count == 1
    time.sleep(0.5)  # paused time is not latency: the virtual clock stood still
    loop.resume()
    wait_until(lambda: len(engine.completed) == 1)
    loop.stop()
    engine.check_integrity()
    # Five paced steps of the sim's ~26 ms each, nothing for the 0.8 s spent paused.
    assert req.finish_time - req.arrival_time < 0.3


def test_paced_sim_keeps_the_modelled_step_times() -> None:
    """A paced sim engine takes as long as its modelled steps, measured over a run: the
    simulated server's clients see the simulated card's timing."""
    engine = Engine(EngineConfig(block_size=16, num_blocks=512), SimExecutor(), pace=1.0)
    records = []
    engine.recorder = records.append
    loop = EngineLoop(engine).start()
    start = time.monotonic()
    for i in range(4):
        engine.add_request([7 + i] * 100, SamplingParams(max_tokens=40, ignore_eos=True))
    wait_until(lambda: len(engine.completed) == 4)
    wall = time.monotonic() - start
    loop.stop()
    modelled = sum(r.dt for r in records if r.dt)
    assert modelled > 1.0  # ~40 decode steps of ~26 ms
    assert abs(wall - modelled) / modelled < 0.10, (wall, modelled)

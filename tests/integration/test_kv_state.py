"""One KV state machine: the live block manager and replay change the KV state through the
same `KVState.apply`. A live run's recorded events, applied to a fresh state, give every
table the live manager had — block tables, window tables, host tables, reservations,
refcounts, the block map and the prefix tree — after every step."""

from __future__ import annotations

from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.runs.trace import synthesize_tokens
from tests.integration.test_engine_sim import drive, workload


def lived(e: Engine, steps: int, tables: list[dict], fork_at: int | None = None) -> None:
    """Step `e`, keeping every table of its KV state after each step."""
    drive(e, steps, tables, fork_at, view=lambda e: e.kv.state.as_data())


def assert_same_tables(run: Path, tables: list[dict]) -> set[str]:
    """Apply the run's records to a fresh state; every table equals the live one after
    every step. Returns the event kinds the run holds."""
    replay = Replay(*read_run(run))
    state = replay.initial_state()
    kinds: set[str] = set()
    for step, (record, expected) in enumerate(zip(replay.steps, tables, strict=True)):
        state.apply(record)
        state.check_integrity()
        kinds |= {ev.kind for ev in record.kv}
        got = state.kv.as_data()
        for key, value in expected.items():
            assert got[key] == value, f"{key} differs after step {step}"
    return kinds


def test_every_table_replays_as_lived_through_swaps_demotions_forks_and_a_relayout(
        tmp_path: Path) -> None:
    # The fitted step model: under it this workload swaps, demotes and promotes (the
    # events under test); the timing only decides when.
    ex = SimExecutor(SimConfig(eos_probability=0.02, timing="fit"), seed=7)
    per_block = 8 * ex.kv_bytes_per_token("fp16")
    e = Engine(EngineConfig(block_size=8, kv_memory_bytes=60 * per_block,
                            host_kv_memory_bytes=40 * per_block, seed=7,
                            knobs=Knobs(max_num_batched_tokens=512, chunk_size=128,
                                        max_num_seqs=16, preemption="swap",
                                        reservation="full")), ex)
    rec = record_headless(e, tmp_path)
    for i, a in enumerate(workload()):
        e.add_request(synthesize_tokens(a, i, 32_000), SamplingParams(max_tokens=a.output_len),
                      request_id=f"r{i}", arrival_time=a.arrival_s)
    tables: list[dict] = []
    lived(e, 30, tables, fork_at=12)
    e.set_knobs(reservation="lazy", eviction_policy="value", preemption="auto")
    lived(e, 30, tables)
    e.set_knobs(kv_format="q8_0")  # re-lays the pool and empties the host tier
    lived(e, 100_000, tables)
    rec.close()
    kinds = assert_same_tables(tmp_path, tables)
    assert {"ref", "unref", "cow", "cache", "evict", "hit", "reserve", "relayout",
            "swap_out", "swap_in", "demote", "promote"} <= kinds, kinds
    assert len(tables) > 50


def test_the_manager_composes_its_window_tables() -> None:
    assert BlockManager.__mro__ == (BlockManager, object)

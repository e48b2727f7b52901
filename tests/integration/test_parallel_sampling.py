"""Parallel sampling (`n` > 1) through fork: one prefill, then branches that share the
prompt's blocks by reference count and copy only what they write — the chapter's example:
four branches of a 95-block prompt with 9 private blocks each hold 131 physical blocks, not
416. On the sim (block bookkeeping and replay) and on Gemma 3 270M (the samples)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import EngineConfig, Knobs
from runtime.engine import Engine
from runtime.errors import RequestError
from runtime.executors.sim import SimConfig, SimExecutor
from runtime.recording import read_run, record_headless
from runtime.replay import Replay
from runtime.request import RequestStatus, SamplingParams
from tests.integration.test_engine_sim import view_of

P = 16
PROMPT = 95 * P + 1  # 95 full blocks, shared; the last prompt token opens block 95
KNOBS = Knobs(max_num_batched_tokens=2048, chunk_size=2048, max_num_seqs=16)


def sim_engine(num_blocks: int = 600) -> Engine:
    config = EngineConfig(block_size=P, num_blocks=num_blocks, seed=3, knobs=KNOBS)
    return Engine(config, SimExecutor(SimConfig(eos_probability=0.0), seed=3))


def physical(e: Engine, reqs) -> set[int]:
    return {b for r in reqs for b in e.kv.tables[r.request_id]}


def test_four_branches_hold_the_prompt_once(tmp_path: Path) -> None:
    e = sim_engine()
    rec = record_headless(e, tmp_path)
    req = e.add_request(list(range(7, 7 + PROMPT)),
                        SamplingParams(max_tokens=200, ignore_eos=True), branches=4)
    branches = [req, *req.branches]
    assert [b.request_id for b in branches[1:]] == [f"{req.request_id}.{i}" for i in (1, 2, 3)]
    seen_nine = False
    live: list[dict] = []
    while e.has_work:
        if e.step() is not None:
            e.check_integrity()
            live.append(view_of(e.snapshot()))
        running = [b for b in branches if b.status is RequestStatus.RUNNING]
        if len(running) < 4 or not all(len(b.output_token_ids) >= 2 for b in branches):
            continue  # until each sample has written past the prompt (and copied its tail)
        shared = PROMPT // P
        private = [e.kv.blocks_needed(b.num_computed_tokens) - shared for b in branches]
        tables = [e.kv.tables[b.request_id] for b in branches]
        assert all(t[:shared] == tables[0][:shared] for t in tables)  # the prompt, once
        assert len(physical(e, branches)) == shared + sum(private)
        if private == [9, 9, 9, 9]:  # the chapter's moment: 131 blocks, not 4 × 104
            seen_nine = True
            assert len(physical(e, branches)) == 131
            assert sum(len(t) for t in tables) == 416
    rec.close()
    assert seen_nine
    assert all(len(b.output_token_ids) == 200 for b in branches)
    # The shared partial tail (block 95, one prompt token) is copied by the first three
    # samples to write into it; the last one then holds it alone.
    assert e.kv.num_cow_copies == 3
    # The recording replays the branches, block for block, step for step.
    replay = Replay(*read_run(tmp_path))
    state = replay.initial_state()
    for step, (record, expected) in enumerate(zip(replay.steps, live, strict=True)):
        state.apply(record)
        state.check_integrity()
        got = view_of(state.snapshot())
        for key in expected:
            assert got[key] == expected[key], f"{key} differs after record {step}"


def test_a_shared_partial_tail_is_copied_on_write() -> None:
    e = sim_engine()
    req = e.add_request(list(range(5, 5 + 40)), SamplingParams(max_tokens=8, ignore_eos=True),
                        branches=3)
    e.run_until_idle()
    e.check_integrity()
    # Block 2 holds prompt positions 32-39: two samples copy it, the third keeps it.
    assert e.kv.num_cow_copies == 2
    assert all(len(b.output_token_ids) == 8 for b in [req, *req.branches])


def test_branches_end_with_a_request_that_never_ran() -> None:
    e = sim_engine(num_blocks=40)
    too_big = e.add_request([3] * (50 * P), SamplingParams(max_tokens=4), branches=3)
    e.run_until_idle()
    for b in [too_big, *too_big.branches]:
        assert b.status is RequestStatus.REJECTED and b.finish_time is not None
    aborted = e.add_request([4] * 30, SamplingParams(max_tokens=4), branches=2)
    e.abort(aborted.request_id, "client went away")
    e.run_until_idle()
    assert aborted.branches[0].status is RequestStatus.ABORTED
    e.check_integrity()
    with pytest.raises(RequestError, match="n must be from 1 to 64"):
        e.add_request([1, 2], SamplingParams(), branches=65)

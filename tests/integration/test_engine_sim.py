"""The engine with the sim executor: determinism, knobs, input limits, trace completeness,
and the executor-failure contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.core.step_data import SchedulerOutput, StepResult
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.errors import (
    ConfigError,
    EngineFailedError,
    QueueFullError,
    RequestError,
    RunFormatError,
    StepError,
)
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival, synthesize_tokens
from kvdeck.runtime.views.snapshot import EngineSnapshot, snapshot_of

KNOBS = Knobs(max_num_batched_tokens=512, chunk_size=128, max_num_seqs=16)


def small_engine(knobs: Knobs = KNOBS, num_blocks: int = 120, seed: int = 7, **cfg) -> Engine:
    config = EngineConfig(block_size=8, num_blocks=num_blocks, seed=seed, knobs=knobs, **cfg)
    return Engine(config, SimExecutor(SimConfig(eos_probability=0.02), seed=seed))


def workload(n: int = 40) -> list[Arrival]:
    # Half share a 96-token system prompt; arrivals every 20 ms.
    return [Arrival(0.02 * i, 150 + (i * 37) % 200, 5 + (i * 13) % 30,
                    prefix_group="sys" if i % 2 == 0 else None, prefix_len=96)
            for i in range(n)]


def record_run(tmp: Path, seed: int = 7) -> bytes:
    e = small_engine(seed=seed)
    rec = record_headless(e, tmp)
    run_arrivals(e, workload(), vocab_size=32_000, on_arrival=rec.arrival)
    rec.close()
    e.check_integrity()
    return (tmp / "iterations.jsonl").read_bytes()


def test_same_seed_gives_byte_identical_traces(tmp_path: Path) -> None:
    a = record_run(tmp_path / "a")
    b = record_run(tmp_path / "b")
    assert a == b and len(a) > 10_000
    assert record_run(tmp_path / "c", seed=8) != a  # the seed matters (sampled EOS differs)
    assert (tmp_path / "a" / "arrivals.jsonl").read_bytes() == \
        (tmp_path / "b" / "arrivals.jsonl").read_bytes()


def view_of(snap: EngineSnapshot) -> dict:
    """What must agree between a live snapshot and its replay: every block's state, the
    prefix tree, each request's progress and accelerator occupancy, and the figures computed
    from request timings."""
    def requests(views):
        return sorted((v.request_id, v.status, v.computed_tokens, v.output_tokens,
                       v.cached_tokens, v.admitted_time, v.num_preemptions, v.block_table,
                       v.occupancy)
                      for v in views)
    f = snap.figures
    w = snap.kv.window  # layer groups: each page in use, full-attention or window
    window = (bytes(g if s else 0 for s, g in zip(snap.kv.states, w.page_groups,
                                                   strict=True)),
              w.full_pages, w.window_pages) if w else None
    # A segment's retention value is the live engine's (its recompute cost): not replayed.
    prefix = tuple(n._replace(p_hit=None, value_ms=None, break_even=None)
                   for n in snap.prefix_nodes)
    return {"states": snap.kv.states, "prefix": prefix, "window": window,
            "running": requests(snap.running), "waiting": requests(snap.waiting),
            "recent": {k: v for k, v in snap.recent.items()},
            "counts": (snap.num_finished, snap.num_rejected, snap.num_aborted,
                       snap.num_preemptions, snap.kv.num_evictions, snap.kv.num_cow_copies,
                       snap.kv.num_reserved, snap.kv.hit_rate),
            "figures": (f.status_counts, f.histograms, f.num_good, f.prompt_tokens,
                        f.generation_tokens, f.history)}


def assert_replays_as_lived(run: Path, live: list[dict]) -> Replay:
    """Replay the run in `run` record by record: after each, the pool holds together and the
    view equals the live one taken after the same step (`view_of`)."""
    replay = Replay(*read_run(run))
    state = replay.initial_state()
    for step, (record, expected) in enumerate(zip(replay.steps, live, strict=True)):
        state.apply(record)
        state.check_integrity()
        got = view_of(state.snapshot())
        for key in expected:
            assert got[key] == expected[key], f"{key} differs after record {step}"
    return replay


def drive(e: Engine, steps: int, live: list[dict], fork_at: int | None = None,
          view=lambda e: view_of(snapshot_of(e))) -> None:
    """Step `e` (the test is its engine thread), capturing `view(e)` after every step; at
    step `fork_at`, branch a running request so copy-on-write happens."""
    for _ in range(steps):
        if fork_at is not None and e.step_count == fork_at:
            parent = next(r for r in e.scheduler.running
                          if r.num_computed_tokens % e.config.block_size)
            e.fork(parent, parent.request_id + "-fork")
        if e.step() is not None:
            e.check_integrity()
            live.append(view(e))
        if not e.has_work:
            break


def every_event_kind(records) -> set[str]:
    return {ev.kind for r in records if isinstance(r, StepRecord) for ev in r.kv}


def test_replay_rebuilds_every_step_with_every_event_kind(tmp_path: Path) -> None:
    # A small pool: evictions, preemptions and sharing happen; full reservation for a while
    # (reserve events); a fork makes a copy-on-write; an abort and a rejection end requests.
    e = small_engine(knobs=Knobs(max_num_batched_tokens=512, chunk_size=128, max_num_seqs=16,
                                 reservation="full"), num_blocks=60)
    rec = record_headless(e, tmp_path)
    for i, a in enumerate(workload()):
        e.add_request(synthesize_tokens(a, i, 32_000), SamplingParams(max_tokens=a.output_len),
                      request_id=f"r{i}", arrival_time=a.arrival_s)
    e.add_request([9] * 700, SamplingParams(max_tokens=10), request_id="too-big")
    live: list[dict] = []
    drive(e, 40, live, fork_at=12)
    e.set_knobs(reservation="lazy", eviction_policy="value")
    e.abort("r39", "client went away")
    drive(e, 100_000, live)
    rec.close()
    _, records = read_run(tmp_path)
    assert every_event_kind(records) == {"ref", "unref", "cow", "cache", "evict", "hit",
                                         "reserve"}
    assert len(assert_replays_as_lived(tmp_path, live).steps) > 50
    statuses = {r.request_id: r.status for r in e.completed}
    assert statuses["too-big"] is RequestStatus.REJECTED
    assert statuses["r39"] is RequestStatus.ABORTED
    assert e.scheduler.num_preemptions > 0 and e.kv.tree.num_evictions > 0


def test_recording_started_mid_run_replays_from_its_checkpoint(tmp_path: Path) -> None:
    e = small_engine(num_blocks=60)
    for i, a in enumerate(workload()):
        e.add_request(synthesize_tokens(a, i, 32_000), SamplingParams(max_tokens=a.output_len),
                      request_id=f"r{i}", arrival_time=a.arrival_s)
    drive(e, 30, [])  # requests in flight, prefixes cached, figures accumulated
    assert e.scheduler.running and e.kv.tree.num_nodes
    rec = record_headless(e, tmp_path)
    live: list[dict] = []
    drive(e, 100_000, live)
    rec.close()
    replay = Replay(*read_run(tmp_path))
    assert replay.checkpoint is not None and replay.checkpoint.requests
    state = replay.initial_state()
    state.check_integrity()
    for step, (record, expected) in enumerate(zip(replay.steps, live, strict=True)):
        state.apply(record)
        assert view_of(state.snapshot()) == expected, f"differs after record {step}"


def test_unknown_record_kind_and_old_format_are_refused(tmp_path: Path) -> None:
    record_run(tmp_path / "run")
    lines = (tmp_path / "run" / "iterations.jsonl").read_text().splitlines()
    (tmp_path / "run" / "iterations.jsonl").write_text(
        "\n".join(lines[:3] + ['{"kind": "teleport", "step": 3}'] + lines[3:]) + "\n")
    with pytest.raises(RunFormatError, match="line 4 has an unknown record kind 'teleport'; "
                                             "this kvdeck reads step, checkpoint, truncated"):
        read_run(tmp_path / "run")
    (tmp_path / "run" / "iterations.jsonl").write_text(
        lines[0] + "\n" + lines[1].replace('["ref"', '["warp"', 1) + "\n")
    with pytest.raises(RunFormatError, match="unknown KV event kind 'warp'"):
        read_run(tmp_path / "run")
    header = json.loads((tmp_path / "run" / "header.json").read_text())
    del header["kvdeck_run"]
    header["kvdeck_trace"] = 1
    (tmp_path / "run" / "header.json").write_text(json.dumps(header))
    with pytest.raises(RunFormatError, match="was recorded in run format 1 and this kvdeck "
                                             "reads format 2"):
        read_run(tmp_path / "run")


def test_knob_change_applies_next_iteration_and_is_recorded() -> None:
    e = small_engine()
    trace: list[dict] = []
    e.recorder = trace.append
    for i in range(6):
        e.add_request([3 + i] * 300, SamplingParams(max_tokens=4), request_id=f"k{i}")
    e.step()
    assert e.scheduler.knobs.chunk_size == 128
    e.set_knobs(chunk_size=32, max_num_batched_tokens=64)
    assert e.scheduler.knobs.chunk_size == 128  # not before the iteration boundary
    e.step()
    assert e.scheduler.knobs.chunk_size == 32
    assert trace[-1].knobs == {"chunk_size": 32, "max_num_batched_tokens": 64}
    assert sum(e.num_new_tokens for e in trace[-1].plan) <= 64
    e.run_until_idle()
    e.check_integrity()


@pytest.mark.parametrize("changes, message", [
    ({"max_num_batched_tokens": -5},
     "max_num_batched_tokens must be an integer from 1 to 1,048,576, got -5."),
    ({"queue_policy": "random"},
     "queue_policy must be one of fcfs, priority, sjf, edf, got 'random'."),
    ({"reservation": "greedy"}, "reservation must be one of full, lazy, got 'greedy'."),
    ({"eviction_policy": "fifo"}, "eviction_policy must be one of lru, value, got 'fifo'."),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false, got 'yes'."),
    ({"turbo": True}, "Unknown knob 'turbo'; knobs are max_num_batched_tokens,"),
])
def test_bad_knob_names_the_knob_and_changes_nothing(changes: dict, message: str) -> None:
    e = small_engine()
    e.add_request([5] * 20, SamplingParams(max_tokens=3))
    before = e.scheduler.knobs
    with pytest.raises(ConfigError) as err:
        e.set_knobs(**changes)
    assert str(err.value).startswith(message)
    e.run_until_idle()
    assert e.scheduler.knobs == before and len(e.completed) == 1


def test_input_limits_are_one_sentence_errors() -> None:
    e = small_engine(max_model_len=100, max_waiting=2)
    with pytest.raises(RequestError, match="The prompt is empty"):
        e.add_request([])
    with pytest.raises(RequestError, match="The prompt has 100 tokens but the model's context "
                                           "allows at most 99."):
        e.add_request([1] * 100)
    with pytest.raises(RequestError, match="max_tokens 50 with a 60-token prompt exceeds the "
                                           "context of 100 tokens; at most 40 new tokens fit."):
        e.add_request([1] * 60, SamplingParams(max_tokens=50))
    with pytest.raises(ConfigError, match="max_tokens must be at least 1, got 0."):
        SamplingParams(max_tokens=0)
    e.add_request([1] * 5)
    e.add_request([1] * 5)
    with pytest.raises(QueueFullError, match=r"The waiting queue is full \(2 requests\)"):
        e.add_request([1] * 5)
    e.run_until_idle()
    e.add_request([1] * 5)  # room again once they finished
    e.run_until_idle()
    assert len(e.completed) == 3


class FailingExecutor(SimExecutor):
    """Fault injection: the step that includes request 'bad' runs out of device memory."""

    def execute(self, plan: SchedulerOutput) -> StepResult:
        if any(c.request_id == "bad" for c in plan.chunks):
            raise StepError("the step ran out of memory on cuda:0 (tried to allocate 2 GiB)")
        return super().execute(plan)


def test_step_error_fails_that_step_and_engine_keeps_serving() -> None:
    e = Engine(EngineConfig(block_size=8, num_blocks=64), FailingExecutor())
    e.add_request([5] * 20, SamplingParams(max_tokens=3), request_id="good")
    e.step()
    e.add_request([6] * 20, SamplingParams(max_tokens=3), request_id="bad")
    e.run_until_idle()
    e.add_request([7] * 20, SamplingParams(max_tokens=3), request_id="after")
    e.run_until_idle()
    e.check_integrity()
    by_id = {r.request_id: r for r in e.completed}
    assert by_id["bad"].status is RequestStatus.ABORTED
    assert by_id["bad"].reason == ("executor error: the step ran out of memory on cuda:0 "
                                   "(tried to allocate 2 GiB)")
    # "good" shared the failing step, so it failed too; "after" ran normally.
    assert by_id["good"].status is RequestStatus.ABORTED
    assert by_id["after"].status is RequestStatus.FINISHED_LENGTH
    assert not e.kv.tables and e.failure is None


class BrokenExecutor(SimExecutor):
    """Fault injection: the n-th step raises as a lost device would; the executor is
    unusable afterwards."""

    def __init__(self, fail_at: int):
        super().__init__(SimConfig())
        self.fail_at = fail_at
        self.steps = 0

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self.steps += 1
        if self.steps >= self.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().execute(plan)


def test_fatal_executor_error_stops_the_engine_and_answers_everyone(tmp_path: Path,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    e = Engine(EngineConfig(block_size=8, num_blocks=64), BrokenExecutor(fail_at=3))
    finished: list[str] = []
    e.on_finish.append(lambda r: finished.append(r.request_id))
    for i in range(3):
        e.add_request([5 + i] * 20, SamplingParams(max_tokens=10), request_id=f"r{i}")
    e.add_request([9] * 20, request_id="later", arrival_time=100.0)
    with pytest.raises(RuntimeError, match="illegal memory access") as caught:
        e.run_until_idle()
    failure = e.fail(caught.value)  # what EngineLoop does with an exception from a step
    assert failure.message == "RuntimeError: CUDA error: an illegal memory access was encountered"
    log = Path(failure.log_path)
    assert log.parent == tmp_path / "logs" and "Traceback" in log.read_text()
    assert sorted(finished) == ["later", "r0", "r1", "r2"]  # every client is answered
    assert all(r.status is RequestStatus.ABORTED and r.reason.startswith("engine failed:")
               for r in e.completed)
    assert not e.kv.tables  # every block came back
    e.check_integrity()
    with pytest.raises(EngineFailedError, match="The engine has stopped"):
        e.add_request([1, 2, 3])
    assert snapshot_of(e).failure == failure

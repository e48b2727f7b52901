"""Priority preemption on arrival (`core/preempt.py`, `preempt_for_arrival`) on the sim: a
high-priority request that finds the pool or the batch full preempts lower-priority running
requests and finishes first; equal priorities are never preempted for it; and the bound
that keeps a stream of high-priority arrivals from starving the rest holds for random
workloads (a property test)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.policies.preemption import ARRIVAL_PREEMPTIONS
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor


def engine(num_blocks: int = 40, max_num_seqs: int = 256, wait_s: float = 30.0,
           preemption: str = "recompute") -> Engine:
    return Engine(EngineConfig(num_blocks=num_blocks, block_size=16, knobs=Knobs(
        queue_policy="priority", max_num_batched_tokens=2048, chunk_size=512,
        max_num_seqs=max_num_seqs, priority_max_wait_s=wait_s, preemption=preemption)),
        SimExecutor(SimConfig(eos_probability=0.0)))


def finish_order(e: Engine) -> list[str]:
    return [r.request_id for r in sorted(e.completed, key=lambda r: r.finish_time)]


def test_a_high_priority_arrival_preempts_when_the_pool_is_full_and_finishes_first() -> None:
    e = engine()
    for i in range(3):  # three 150-token prompts growing to 250 tokens: 48 blocks > 40
        e.add_request([3 + i] * 150, SamplingParams(max_tokens=100, ignore_eos=True),
                      request_id=f"low{i}", priority=5)
    for _ in range(5):
        e.step()
    assert len(e.scheduler.running) == 3 and e.kv.pool.num_free < 13
    e.add_request([9] * 200, SamplingParams(max_tokens=20, ignore_eos=True),
                  request_id="high", priority=0)
    rec = e.step()
    assert rec.preempted == ["low2"] and rec.admitted == ["high"]  # latest admitted goes
    victim = e.find("low2")
    assert victim.num_arrival_preemptions == 1 and "for higher-priority high" in \
        victim.events[-1][1]
    e.run_until_idle()
    e.check_integrity()
    assert finish_order(e)[0] == "high"
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in e.completed)


def test_a_full_batch_makes_room_too_but_never_for_an_equal_priority() -> None:
    e = engine(num_blocks=400, max_num_seqs=2)
    for i in range(2):
        e.add_request([3 + i] * 64, SamplingParams(max_tokens=50, ignore_eos=True),
                      request_id=f"mid{i}", priority=3)
    e.step()
    e.add_request([7] * 64, SamplingParams(max_tokens=5, ignore_eos=True),
                  request_id="same", priority=3)
    assert e.step().preempted == []  # equal priority waits its turn
    e.add_request([8] * 64, SamplingParams(max_tokens=5, ignore_eos=True),
                  request_id="urgent", priority=1)
    rec = e.step()
    assert rec.preempted == ["mid1"] and rec.admitted == ["urgent"]
    e.run_until_idle()
    e.check_integrity()
    assert finish_order(e)[0] == "urgent"


def test_swap_preemption_serves_a_priority_arrival_and_keeps_the_victims_progress() -> None:
    e = Engine(EngineConfig(num_blocks=40, block_size=16, host_kv_memory_bytes=1 << 30,
                            knobs=Knobs(queue_policy="priority", preemption="swap",
                                        chunk_size=512)),
               SimExecutor(SimConfig(eos_probability=0.0)))
    for i in range(3):
        e.add_request([3 + i] * 150, SamplingParams(max_tokens=100, ignore_eos=True),
                      request_id=f"low{i}", priority=5)
    for _ in range(5):
        e.step()
    e.add_request([9] * 200, SamplingParams(max_tokens=20, ignore_eos=True),
                  request_id="high", priority=0)
    rec = e.step()
    assert rec.swapped == rec.preempted == ["low2"] and rec.admitted == ["high"]
    e.run_until_idle()
    e.check_integrity()
    assert finish_order(e)[0] == "high"


arrivals = st.lists(st.tuples(st.integers(0, 3),  # priority
                              st.integers(16, 200),  # prompt tokens
                              st.integers(1, 60),  # output tokens
                              st.floats(0.0, 0.3)),  # gap to the previous arrival, s
                    min_size=2, max_size=30)


@settings(max_examples=40, deadline=None)
@given(arrivals, st.sampled_from([0.2, 1.0, 30.0]))
def test_high_priority_streams_cannot_starve_anyone(items, wait_s: float) -> None:
    """Every request finishes; none is preempted for arrivals more than the bound; and no
    request that has waited `priority_max_wait_s` sees a younger one admitted before it."""
    e = engine(num_blocks=48, max_num_seqs=6, wait_s=wait_s)
    t = 0.0
    for i, (prio, prompt, out, gap) in enumerate(items):
        t += gap
        e.add_request([3 + i % 50] * prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                      request_id=f"r{i}", arrival_time=t, priority=prio)
    while e.has_work:
        now = e.clock.now()
        aged = {r.request_id: r.arrival_time for r in e.scheduler.waiting
                if now - r.arrival_time >= wait_s}
        rec = e.step()
        e.check_integrity()
        if rec is None or not aged:
            continue
        for rid in rec.admitted:
            if rid not in aged:  # a younger, unaged request got in: no aged one was left
                assert all(a in rec.admitted for a in aged), (rid, aged)
    assert len(e.completed) == len(items)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in e.completed)
    assert all(r.num_arrival_preemptions <= ARRIVAL_PREEMPTIONS for r in e.completed)

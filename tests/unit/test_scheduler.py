"""Scheduler behaviour with the sim executor: budgets, ordering, chunking, static mode,
preemption, abort, admission control and queue policies."""

from __future__ import annotations

import random

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor


def engine(num_blocks: int = 256, block_size: int = 16, **knobs) -> Engine:
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, knobs=Knobs(**knobs))
    return Engine(cfg, SimExecutor(SimConfig(), seed=1))


def plans(e: Engine) -> list[StepRecord]:
    """Step to idle, returning each step's record, checking integrity every step."""
    out: list[StepRecord] = []
    e.recorder = out.append
    while e.has_work:
        e.step()
        e.check_integrity()
    e.recorder = None
    return out


def add_random(e: Engine, n: int, seed: int = 0, max_prompt: int = 600) -> None:
    rng = random.Random(seed)
    for i in range(n):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, max_prompt))]
        e.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 40)),
                      request_id=f"q{i}", arrival_time=rng.random() * 2)


def assert_drained(e: Engine) -> None:
    e.check_integrity()
    assert not e.kv.tables and e.kv.num_reserved == 0
    assert e.kv.pool.num_used == e.kv.tree.num_nodes  # only the prefix cache holds blocks
    e.kv.clear_cache()
    assert e.kv.pool.num_free == e.kv.num_blocks


@pytest.mark.parametrize("reservation", ["lazy", "full"])
def test_budgets_never_exceeded(reservation: str) -> None:
    e = engine(max_num_batched_tokens=256, max_num_seqs=8, chunk_size=64,
               reservation=reservation)
    add_random(e, 60)
    records = plans(e)
    assert records
    for rec in records:
        plan = rec.plan
        assert sum(e.num_new_tokens for e in plan) <= 256
        assert len(plan) <= 8
    assert len(e.completed) == 60
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in e.completed)
    assert all(r.num_output_tokens == r.sampling.max_tokens for r in e.completed)
    assert_drained(e)


def test_decodes_first_and_long_prompts_chunked() -> None:
    e = engine(max_num_batched_tokens=100, chunk_size=48)
    e.add_request([5] * 10, SamplingParams(max_tokens=30), request_id="short")
    e.add_request(list(range(3, 400)), SamplingParams(max_tokens=2), request_id="long",
                  arrival_time=0.001)
    records = plans(e)
    prompt_len = {"short": 10, "long": 397}
    long_chunks = []
    for rec in records:
        plan = rec.plan
        is_decode = [e.start >= prompt_len[e.request_id] for e in plan]
        # Every decode chunk comes before any prefill chunk in the plan.
        assert is_decode == sorted(is_decode, reverse=True)
        long_chunks += [e.num_new_tokens for e in plan if e.request_id == "long" and e.start < 397]
    assert max(long_chunks) <= 48 and sum(long_chunks) == 397
    assert len(long_chunks) == -(-397 // 48)  # 9 chunks: the decode never crowds it out here
    assert_drained(e)


@pytest.mark.parametrize("cuts", ["", "516,4"])
def test_prompt_cuts_end_chunks_where_llama_server_checkpoints(cuts: str) -> None:
    """With cuts at 516 and 4 tokens before a prompt's end (llama-server's on a model with
    sliding-window layers, ubatch 512), a lone 768-token prompt runs as 252, 512 and 4
    tokens, and a second sent after the first step catches up with it: their first tokens
    come a step apart. Without cuts the first runs whole and is done before the second
    starts."""
    cfg = EngineConfig(num_blocks=256, prompt_cuts=cuts,
                       knobs=Knobs(max_num_batched_tokens=2048, chunk_size=2048))
    e = Engine(cfg, SimExecutor(SimConfig(), seed=1))
    e.add_request([3 + i % 90 for i in range(768)], SamplingParams(max_tokens=3),
                  request_id="A")
    steps = [[(c.request_id, c.start, c.num_new_tokens) for c in e.step().plan]]
    e.add_request([100 + i % 90 for i in range(768)], SamplingParams(max_tokens=3),
                  request_id="B")
    while e.has_work:
        steps.append([(c.request_id, c.start, c.num_new_tokens) for c in e.step().plan])
        e.check_integrity()
    first = {rid: next(i for i, s in enumerate(steps) for r, start, n in s
                       if r == rid and start + n == 768) for rid in "AB"}
    if cuts:
        assert steps[:3] == [[("A", 0, 252)], [("A", 252, 512), ("B", 0, 252)],
                             [("A", 764, 4), ("B", 252, 512)]]
        assert first == {"A": 2, "B": 3}
    else:
        assert steps[0] == [("A", 0, 768)] and first == {"A": 0, "B": 1}
    assert len(e.completed) == 2
    with pytest.raises(ConfigError, match="prompt_cuts must be comma-separated token counts"):
        EngineConfig(prompt_cuts="516,x")


def test_static_mode_never_admits_into_a_running_group() -> None:
    e = engine(max_num_seqs=4, scheduling="static", enable_prefix_caching=False)
    add_random(e, 12, seed=3, max_prompt=100)
    running: set[str] = set()
    for rec in plans(e):
        if rec.admitted:
            assert not running, "admitted while a static group was still running"
            running |= set(rec.admitted)
        for rid, *_ in rec.finished:
            running.discard(rid)
    assert len(e.completed) == 12
    assert_drained(e)


def test_preemption_recomputes_and_releases_everything() -> None:
    # 12 blocks of 4 tokens: three requests growing to 30 tokens cannot all stay resident.
    e = engine(num_blocks=12, block_size=4, reservation="lazy", enable_prefix_caching=False)
    for i in range(3):
        e.add_request([10 + i] * 10, SamplingParams(max_tokens=20), request_id=f"p{i}")
    records = plans(e)
    preempted = [rid for rec in records for rid in rec.preempted]
    assert preempted, "the pool is too small for all three: someone must be preempted"
    # The victim is the most recently admitted request (vLLM's choice).
    assert preempted[0] == "p2"
    done = {r.request_id: r for r in e.completed}
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 20
               for r in done.values())
    assert done["p2"].num_preemptions >= 1
    assert_drained(e)


def test_recompute_after_preemption_reuses_cached_blocks() -> None:
    e = engine(num_blocks=14, block_size=4, reservation="lazy")
    for i in range(3):
        e.add_request([20 + i] * 12, SamplingParams(max_tokens=16), request_id=f"c{i}")
    plans(e)
    victims = [r for r in e.completed if r.num_preemptions]
    assert victims and all(r.status is RequestStatus.FINISHED_LENGTH for r in e.completed)
    assert_drained(e)


def test_abort_running_and_waiting() -> None:
    e = engine(max_num_seqs=1)
    e.add_request([7] * 50, SamplingParams(max_tokens=100), request_id="run")
    e.add_request([8] * 50, SamplingParams(max_tokens=100), request_id="wait")
    e.step()
    e.step()
    assert [r.request_id for r in e.scheduler.running] == ["run"]
    e.abort("run")
    e.abort("wait")
    e.abort("no-such-request")  # unknown ids are ignored
    e.step()
    e.check_integrity()
    statuses = {r.request_id: (r.status, r.reason) for r in e.completed}
    assert statuses == {"run": (RequestStatus.ABORTED, "aborted by client"),
                        "wait": (RequestStatus.ABORTED, "aborted by client")}
    assert_drained(e)


def test_request_that_never_fits_is_rejected_with_reason() -> None:
    e = engine(num_blocks=4, block_size=4, reservation="full")
    e.add_request([3] * 10, SamplingParams(max_tokens=20), request_id="big")
    plans(e)
    (r,) = e.completed
    assert r.status is RequestStatus.REJECTED
    assert r.reason == ("needs 8 KV blocks for prompt + max_tokens − 1 (29 tokens) but the "
                        "pool has 4 blocks of 4 tokens")
    assert_drained(e)


def test_deadline_admission_control() -> None:
    e = engine(admission_control=True)
    # 26 ms per decode step on the fitted reference: 200 tokens need ~5.3 s.
    e.add_request([4] * 100, SamplingParams(max_tokens=200), request_id="late",
                  deadline_s=1.0)
    e.add_request([5] * 100, SamplingParams(max_tokens=10), request_id="ok", deadline_s=1.0)
    plans(e)
    by_id = {r.request_id: r for r in e.completed}
    assert by_id["late"].status is RequestStatus.REJECTED
    assert by_id["late"].reason.startswith("cannot meet its deadline: forecast finish")
    assert by_id["ok"].status is RequestStatus.FINISHED_LENGTH
    assert by_id["ok"].finish_time <= by_id["ok"].deadline
    assert_drained(e)


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["a", "b", "c"]),
    ("priority", ["c", "b", "a"]),
    ("sjf", ["b", "c", "a"]),
    ("edf", ["c", "a", "b"]),
])
def test_queue_policies_order_admission(policy: str, expected: list[str]) -> None:
    e = engine(max_num_seqs=1, queue_policy=policy, enable_prefix_caching=False)
    specs = {"a": (30, 2, 9.0), "b": (5, 1, 20.0), "c": (10, 0, 3.0)}  # len, priority, deadline
    for i, (rid, (n, prio, dl)) in enumerate(specs.items()):
        e.add_request([3 + i] * n, SamplingParams(max_tokens=2), request_id=rid,
                      arrival_time=0.0, priority=prio, deadline_s=dl)
    e.add_request([99], SamplingParams(max_tokens=40), request_id="first")  # occupies the seat
    order = [rid for rec in plans(e) for rid in rec.admitted if rid != "first"]
    assert order == expected


def test_sjf_aging_lets_a_long_wait_go_first() -> None:
    e = engine(max_num_seqs=1, queue_policy="sjf", sjf_max_wait_s=0.5,
               enable_prefix_caching=False)
    e.add_request([9] * 5, SamplingParams(max_tokens=60), request_id="busy")
    e.add_request([3] * 300, SamplingParams(max_tokens=2), request_id="long", arrival_time=0.0)
    for i in range(5):  # a stream of short requests arriving later
        e.add_request([4 + i] * 5, SamplingParams(max_tokens=2), request_id=f"s{i}",
                      arrival_time=0.2 + 0.01 * i)
    order = [rid for rec in plans(e) for rid in rec.admitted if rid != "busy"]
    assert order[0] == "long"  # it waited past 0.5 s while "busy" ran


def shared_prompt_burst(e: Engine, n: int, shared: int, own: int) -> None:
    """`n` requests arriving together, their prompts `shared` tokens alike, then `own`
    tokens each."""
    rng = random.Random(7)
    system = [rng.randrange(3, 1000) for _ in range(shared)]
    for i in range(n):
        tail = [rng.randrange(3, 1000) for _ in range(own)]
        e.add_request(system + tail, SamplingParams(max_tokens=8), request_id=f"s{i}",
                      arrival_time=0.0)


@pytest.mark.parametrize("wait", [True, False])
def test_a_burst_sharing_a_new_prompt_computes_it_once_with_prefix_wait(wait: bool) -> None:
    """Eight requests arrive at once with the same 1,024-token system prompt, which is not
    cached yet. With prefix_wait the first computes it and the others wait for its blocks,
    then compute only their own 128 tokens; without it the requests admitted before its
    first blocks are cached compute them again."""
    e = engine(num_blocks=1024, max_num_batched_tokens=512, chunk_size=256, max_num_seqs=8,
               prefix_wait=wait)
    shared_prompt_burst(e, 8, 1024, 128)
    records = plans(e)
    prefill = sum(p.num_new_tokens for r in records for p in r.plan) - \
        sum(r.num_decode for r in records)
    cached = sum(r.num_cached_tokens for r in e.completed)
    assert len(e.completed) == 8 and all(r.status is RequestStatus.FINISHED_LENGTH
                                         for r in e.completed)
    if wait:
        assert cached == 7 * 1024
        assert prefill == 1024 + 8 * 128
        assert any(r.limit and "prefix wait" in r.limit for r in records)
    else:  # the first steps' admissions compute it side by side before any block is cached
        assert prefill == 2 * 1024 + 8 * 128 and cached == 6 * 1024
    assert_drained(e)


def test_prefix_wait_never_holds_a_request_that_shares_nothing_more() -> None:
    """A request whose prompt diverges within the first block from everything being
    prefilled is admitted at once, beside them."""
    e = engine(num_blocks=1024, max_num_batched_tokens=2048, chunk_size=2048)
    shared_prompt_burst(e, 1, 1024, 128)
    e.add_request(list(range(3, 3 + 600)), SamplingParams(max_tokens=4), request_id="other",
                  arrival_time=0.0)
    first = plans(e)[0]
    assert {p.request_id for p in first.plan} == {"s0", "other"}

"""Prefix-cache admission (`runtime/kv/cache_admission.py`) on the sim: with k = 2 a prefix
is cached from its second sighting on, one-off prompts stay private, a hot system prompt
survives a stream of one-off prompts in a small cache that admitting everything flushes, and
the knob changes behaviour live."""

from __future__ import annotations

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.kv.cache_admission import CacheAdmission

SP = SamplingParams(max_tokens=4, ignore_eos=True)


def engine(k: int, capacity: int = 0) -> Engine:
    return Engine(EngineConfig(num_blocks=400, block_size=16, knobs=Knobs(
        cache_admission_k=k, prefix_cache_capacity=capacity)),
        SimExecutor(SimConfig(eos_probability=0.0)))


def serve(e: Engine, prompt: list[int], rid: str) -> int:
    """Run one request alone; the prompt tokens it found cached."""
    req = e.add_request(prompt, SP, request_id=rid)
    e.run_until_idle()
    e.check_integrity()
    return req.num_cached_tokens


def test_a_prefix_is_cached_from_its_kth_sighting() -> None:
    prompt = list(range(100, 164)) + [7]  # four full blocks and a token
    e = engine(2)
    assert serve(e, prompt, "a") == 0 and e.kv.tree.num_nodes == 0  # seen once: private
    assert serve(e, prompt, "b") == 0 and e.kv.tree.num_nodes == 4  # seen twice: cached
    assert serve(e, prompt, "c") == 64
    every = engine(1)
    assert serve(every, prompt, "a") == 0 and serve(every, prompt, "b") == 64


def test_a_hot_prefix_survives_one_off_prompts_that_admitting_everything_lets_flush_it(
) -> None:
    system = list(range(1000, 1064))  # 4 blocks
    hits = {}
    for k in (1, 2):
        e = engine(k, capacity=8)
        cached = 0
        for i in range(12):
            cached += serve(e, system + [2000 + i] * 3, f"hot{i}")
            serve(e, [3000 + 97 * i + j for j in range(128)], f"once{i}")  # 8 blocks, once
        hits[k] = cached
    assert hits[1] == 0  # each one-off prompt's 8 blocks evicted the 4 hot ones
    assert hits[2] >= 10 * 64  # cached from the second request on, never flushed


def test_the_admission_knob_changes_behaviour_live() -> None:
    e = engine(1)
    assert serve(e, list(range(64)) + [1], "a") == 0 and e.kv.tree.num_nodes == 4
    e.set_knobs(cache_admission_k=3)
    serve(e, list(range(500, 564)) + [1], "b")
    assert e.kv.tree.num_nodes == 4  # the new prompt stayed private
    e.set_knobs(cache_admission_k=1)
    serve(e, list(range(900, 964)) + [1], "c")
    assert e.kv.tree.num_nodes == 8


def test_the_window_forgets_old_sightings() -> None:
    a = CacheAdmission(k=2, window=2)
    blocks = [(1, 2), (3, 4)]
    a.on_admit("r1", "ns", blocks, first=True)
    a.on_admit("r2", "ns", [(9, 9)], first=True)
    a.on_admit("r3", "ns", [(8, 8)], first=True)  # r1's sighting leaves the window
    a.on_admit("r4", "ns", blocks, first=True)
    assert not a.allows("r4", 0, blocks[0], "ns")
    a.on_admit("r5", "ns", blocks, first=True)
    assert a.allows("r5", 1, blocks[1], "ns")
    a.on_admit("r5", "ns", blocks, first=False)  # a readmission is not a sighting
    assert a._seen[a._hashes["r5"][0]] == 2
    # Another namespace (another KV format) is another prefix.
    a.on_admit("r6", "other", blocks, first=True)
    assert not a.allows("r6", 0, blocks[0], "other")


def test_the_prefix_panel_prices_each_segment_as_the_value_policy_does() -> None:
    """A prefix shared by every request is more likely hit, and worth more, than the private
    tails; on the reference card's PCIe link keeping it on the host pays above a small
    break-even hit chance."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.executors.sim import SimExecutor
    from kvdeck.runtime.runs.runner import run_arrivals
    from kvdeck.runtime.runs.trace import Arrival
    from kvdeck.runtime.views.snapshot import snapshot_of

    engine = Engine(EngineConfig(knobs=Knobs(max_num_batched_tokens=4096, chunk_size=4096)),
                    SimExecutor())
    run_arrivals(engine, [Arrival(0.1 * i, 2048 + 256, 8, prefix_group="sys", prefix_len=2048)
                          for i in range(6)], vocab_size=32_000)
    engine.check_integrity()
    nodes = snapshot_of(engine).prefix_nodes
    shared = next(n for n in nodes if n.start_token == 0)
    tails = [n for n in nodes if n.start_token > 0]
    assert shared.hits == 5 and tails
    assert all(shared.p_hit > t.p_hit and shared.value_ms > t.value_ms for t in tails)
    assert 0 < shared.break_even < 0.1

"""Token-level KV eviction's decisions in the block manager (`kv/eviction.py`): what each
mode keeps, that evicted blocks return to the pool as holes, that the prefix cache takes
only blocks computed over a whole context, forks and releases with holes, the events
replaying into the same state, and what eviction refuses to go with."""

from __future__ import annotations

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.kv.block_pool import BlockStates
from kvdeck.runtime.kv.events import Drop, kv_event_from_json, kv_event_to_json
from kvdeck.runtime.kv.eviction import Eviction, evicted_ranges
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.kv.state import KVState

P = 4


def make(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens))


def prefill(mgr: BlockManager, req: Request, chunk: int,
            scores=None) -> list[int]:
    """Compute `req`'s prompt `chunk` tokens a step, evicting after each; the most blocks
    it held at once."""
    most = []
    mgr.admit(req, min(chunk, req.num_prompt_tokens), False)
    while True:
        n = min(chunk, req.num_prompt_tokens - req.num_computed_tokens)
        if req.num_computed_tokens:
            assert mgr.can_allocate(req, n)
            mgr.allocate(req, n)
        most.append(sum(b >= 0 for b in mgr.tables[req.request_id]))
        req.num_computed_tokens += n
        mgr.cache_computed(req)
        table = mgr.tables[req.request_id]
        mgr.evict_tokens(req, scores(table) if scores else None)
        mgr.check_integrity()
        if req.num_computed_tokens == req.num_prompt_tokens:
            return most


def test_sink_window_keeps_the_sinks_and_the_recent_window() -> None:
    mgr = BlockManager(12, P, eviction=Eviction("sink-window", sink_tokens=4,
                                                   recent_tokens=8))
    req = make("long", 60)  # 15 blocks: more than the pool
    most = prefill(mgr, req, chunk=8)
    assert max(most) <= mgr.pages_for(60, 8) <= 12
    table = mgr.tables["long"]
    # Next position 60: tokens 52..59 are recent (blocks 13, 14); block 0 is the sink.
    assert [k for k, b in enumerate(table) if b >= 0] == [0, 13, 14]
    assert evicted_ranges(table, P) == [(4, 52)]
    assert mgr.eviction.num_evicted_blocks == 12
    assert mgr.num_used_blocks <= 3 + mgr.tree.num_nodes
    mgr.release(req)
    mgr.check_integrity()
    assert mgr.pool.num_held == 0 and not mgr.eviction.decided


def test_heavy_hitter_keeps_the_most_attended_blocks() -> None:
    mgr = BlockManager(16, P, enable_caching=False, eviction=Eviction(
        "heavy-hitter", sink_tokens=4, recent_tokens=8, heavy_tokens=8))
    req = make("hh", 48)
    # Blocks 3 and 7 draw the most attention every step; the rest a little each.
    prefill(mgr, req, chunk=4, scores=lambda t: [5.0 if k in (3, 7) else 0.1
                                                 for k in range(len(t))])
    kept = [k for k, b in enumerate(mgr.tables["hh"]) if b >= 0]
    assert kept == [0, 3, 7, 10, 11]  # sink, the two heavy hitters, the recent window
    assert mgr.eviction.heavy["hh"] == [3, 7]


def test_a_request_long_enough_to_evict_neither_caches_nor_reuses() -> None:
    mgr = BlockManager(24, P, eviction=Eviction("sink-window", sink_tokens=4,
                                                   recent_tokens=8))
    short = make("short", 8, max_tokens=4)  # 11 tokens at most: never evicts
    prefill(mgr, short, chunk=8)
    assert mgr.tree.num_nodes == 2
    long = make("long", 40)
    assert mgr.peek_prefix(long) == 0  # though its first two blocks are cached
    prefill(mgr, long, chunk=8)
    assert mgr.tree.num_nodes == 2 and mgr.eviction.num_evicted_blocks
    for r in (short, long):
        mgr.release(r)
    again = make("again", 8, max_tokens=4)
    assert mgr.peek_prefix(again) == 4  # its last token is never reused: one block
    mgr.check_integrity()


def test_a_fork_shares_the_kept_blocks_and_the_holes() -> None:
    mgr = BlockManager(16, P, eviction=Eviction("sink-window", sink_tokens=4,
                                                   recent_tokens=8))
    parent = make("p", 30)
    prefill(mgr, parent, chunk=8)
    child = make("c", 30)
    mgr.fork(parent, child)
    assert mgr.tables["c"] == mgr.tables["p"][:len(mgr.tables["c"])]
    assert -1 in mgr.tables["c"]
    mgr.check_integrity()
    for r in (parent, child):
        mgr.release(r)
    mgr.check_integrity()
    assert mgr.pool.num_held == 0


def test_the_events_replay_into_the_same_state() -> None:
    mgr = BlockManager(12, P, enable_caching=False, eviction=Eviction(
        "sink-window", sink_tokens=4, recent_tokens=8))
    req = make("r", 40)
    prefill(mgr, req, chunk=8)
    events = [kv_event_from_json(kv_event_to_json(e), "test") for e in mgr.take_events()]
    assert any(isinstance(e, Drop) for e in events)
    replay = KVState(BlockStates(12, P), record=False)
    for e in events:
        replay.apply(e)
    replay.check_integrity()
    assert replay.tables == mgr.tables
    with pytest.raises(ValueError, match="cannot evict block"):
        replay.apply(Drop("r", len(replay.tables["r"]) - 1, replay.tables["r"][-1]))


def test_eviction_refuses_what_it_cannot_go_with() -> None:
    def build(**kw) -> Engine:
        knobs = kw.pop("knobs", {})
        return Engine(EngineConfig(block_size=16, num_blocks=64, **kw,
                                   knobs=Knobs(**knobs)), SimExecutor(SimConfig(), seed=1))

    with pytest.raises(ConfigError, match="^kv_eviction needs an executor that reads block "
                       "tables with evicted holes .the torch executor.; the sim executor "
                       "does not.$"):
        build(kv_eviction="sink-window")
    with pytest.raises(ConfigError, match="^kv_eviction sink-window cannot go with a host KV "
                       "tier"):
        build(kv_eviction="sink-window", host_kv_memory_bytes=1 << 20)
    with pytest.raises(ConfigError, match="^kv_eviction heavy-hitter cannot go with full "
                       "reservation"):
        build(kv_eviction="heavy-hitter", knobs={"reservation": "full"})
    with pytest.raises(ConfigError, match="^kv_eviction must be one of off, sink-window, "
                       "heavy-hitter, got 'lru'.$"):
        EngineConfig(kv_eviction="lru")
    with pytest.raises(ConfigError, match="^kv_recent_tokens must be an integer from 16"):
        EngineConfig(kv_eviction="sink-window", kv_recent_tokens=8)


def test_without_eviction_a_prompt_past_the_pool_is_refused_with_a_sentence() -> None:
    e = Engine(EngineConfig(block_size=16, num_blocks=8), SimExecutor(SimConfig(), seed=1))
    e.add_request([5] * 200, SamplingParams(max_tokens=4), request_id="big")
    e.run_until_idle()
    (r,) = e.completed
    assert r.reason == ("needs 13 KV blocks for its prompt (200 tokens) but the pool has 8 "
                        "blocks of 16 tokens (token-level eviction, --kv-eviction "
                        "sink-window, would run it lossily)")

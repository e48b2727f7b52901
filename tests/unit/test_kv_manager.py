"""Specific behaviours of the block manager and prefix tree, each checked with integrity."""

from __future__ import annotations

import re

import pytest

from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.kv.events import Evict
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.kv.prefix_node import block_keys


def make(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


def run_prompt(mgr: BlockManager, req: Request, reserve_full: bool = False) -> None:
    """Admit and compute the whole prompt in one chunk, then sample one token."""
    n = req.num_prompt_tokens - mgr.peek_prefix(req)
    assert mgr.can_admit(req, n, reserve_full)
    mgr.admit(req, n, reserve_full)
    assert len(mgr.tables[req.request_id]) == mgr.blocks_needed(req.num_prompt_tokens)
    req.num_computed_tokens = req.num_prompt_tokens
    req.output_token_ids.append(7)
    mgr.cache_computed(req)
    mgr.check_integrity()


def decode(mgr: BlockManager, req: Request, token: int = 9) -> list[tuple[int, int]]:
    assert mgr.can_allocate(req, 1)
    cows = mgr.allocate(req, 1)
    req.num_computed_tokens += 1
    req.output_token_ids.append(token)
    mgr.cache_computed(req)
    mgr.check_integrity()
    return cows


def test_shared_prefix_stored_once() -> None:
    # n branches, s shared full blocks, t private blocks each: s + n·t physical blocks.
    p, s, t, n = 4, 3, 2, 5
    mgr = BlockManager(64, p)
    prefix = list(range(100, 100 + s * p))
    reqs = []
    for i in range(n):
        req = make(f"r{i}", prefix + [i] * (t * p))
        run_prompt(mgr, req)
        reqs.append(req)
    assert mgr.num_used_blocks == s + n * t
    # Later branches reused the prefix instead of computing it.
    assert [r.num_cached_tokens for r in reqs] == [0] + [s * p] * (n - 1)
    for r in reqs:
        mgr.release(r)
    mgr.check_integrity()


def test_last_prompt_token_is_never_reused() -> None:
    mgr = BlockManager(16, 4)
    a = make("a", list(range(8)))
    run_prompt(mgr, a)
    b = make("b", list(range(8)))  # identical, a multiple of the block size
    assert mgr.peek_prefix(b) == 4  # only the first block: the second holds the last token
    run_prompt(mgr, b)
    assert b.num_cached_tokens == 4
    mgr.release(a)
    mgr.release(b)
    mgr.check_integrity()


def test_fork_then_write_copies_the_shared_tail() -> None:
    mgr = BlockManager(16, 4)
    parent = make("p", [1, 2, 3, 4, 5, 6])  # 1 full block + a partial tail of 2
    run_prompt(mgr, parent)
    child = make("c", parent.prompt_token_ids)
    child.output_token_ids = list(parent.output_token_ids)
    mgr.fork(parent, child)
    shared_tail = mgr.tables["p"][1]
    assert mgr.tables["c"] == mgr.tables["p"] and mgr.pool.refcount[shared_tail] == 2
    cows = decode(mgr, child)
    assert cows == [(shared_tail, mgr.tables["c"][1])]
    assert mgr.tables["c"][0] == mgr.tables["p"][0]  # the full block stays shared
    assert mgr.tables["c"][1] != shared_tail and mgr.pool.refcount[shared_tail] == 1
    assert decode(mgr, parent) == []  # the parent now owns its tail alone: no copy
    for r in (parent, child):
        mgr.release(r)
    mgr.check_integrity()


def test_full_reservation_promises_blocks_up_front() -> None:
    mgr = BlockManager(10, 4, enable_caching=False)
    req = make("r", [1] * 5, max_tokens=8)  # 5 + 8 − 1 = 12 tokens -> 3 blocks
    run_prompt(mgr, req, reserve_full=True)
    assert len(mgr.tables["r"]) == 2 and mgr.num_reserved == 1
    assert mgr.num_available_blocks() == 10 - 3
    other = make("o", [2] * 29, max_tokens=1)  # needs 8 blocks: only 7 unpromised
    assert not mgr.can_admit(other, 29, reserve_full=True)
    for _ in range(7):
        decode(mgr, req)
    assert len(mgr.tables["r"]) == 3 and mgr.num_reserved == 0
    mgr.release(req)
    mgr.check_integrity()
    assert mgr.pool.num_free == 10


def test_release_during_a_step_is_deferred() -> None:
    mgr = BlockManager(8, 4, enable_caching=False)
    req = make("r", [1] * 6)
    run_prompt(mgr, req)
    blocks = list(mgr.tables["r"])
    mgr.begin_step()
    mgr.release(req)
    assert all(mgr.pool.refcount[b] == 1 for b in blocks) and mgr.pool.num_free == 6
    mgr.end_step()
    assert mgr.pool.num_free == 8
    mgr.check_integrity()


def test_truncate_releases_whole_blocks() -> None:
    mgr = BlockManager(8, 4, enable_caching=False)
    req = make("r", list(range(10)))
    run_prompt(mgr, req)
    assert len(mgr.tables["r"]) == 3
    mgr.truncate(req, 5)
    assert len(mgr.tables["r"]) == 2 and req.num_computed_tokens == 5
    mgr.truncate(req, 4)
    assert len(mgr.tables["r"]) == 1
    mgr.release(req)
    mgr.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_eviction_order(policy: str) -> None:
    clock = [0.0]
    mgr = BlockManager(6, 2, eviction_policy=policy, clock=lambda: clock[0])
    # Two cached prefixes; "hot" is looked up again before both become evictable.
    for rid, base in (("cold", 10), ("hot", 20)):
        clock[0] += 1
        r = make(rid, [base, base + 1, base + 2])
        run_prompt(mgr, r)
        mgr.release(r)
    clock[0] += 1
    again = make("again", [20, 21, 22])
    run_prompt(mgr, again)
    mgr.release(again)
    mgr.check_integrity()
    # Under both policies the cold block goes first: least recent, and fewest hits.
    cold_block = mgr.tree.match("default", block_keys([10, 11], mgr.block_size))[0].block
    assert mgr.tree.evict_one() == cold_block
    mgr.check_integrity()


def test_capacity_caps_the_cache() -> None:
    mgr = BlockManager(32, 2, cache_capacity=3)
    for i in range(6):
        r = make(f"r{i}", [i, i, i, i, i])  # 2 full blocks each
        run_prompt(mgr, r)
        mgr.release(r)
        assert mgr.tree.num_nodes <= 3
    mgr.check_integrity()


def test_allocation_evicts_cached_blocks_when_the_pool_is_full() -> None:
    mgr = BlockManager(4, 2)
    a = make("a", [1, 1, 1, 1, 1])  # 3 blocks; 2 full ones get cached
    run_prompt(mgr, a)
    mgr.release(a)
    assert mgr.pool.num_free == 2 and mgr.tree.num_evictable == 2
    b = make("b", [2] * 7)  # 4 blocks: must evict both cached ones
    assert mgr.can_admit(b, 7, reserve_full=False)
    run_prompt(mgr, b)
    assert mgr.tree.num_evictions == 2
    events = mgr.take_events()
    assert sum(1 for e in events if isinstance(e, Evict)) == 2
    mgr.release(b)
    mgr.check_integrity()


def test_dedupe_of_a_forked_block_never_breaks_a_reservation() -> None:
    # Found by the state machine: a fork's child holds, with its parent, a full block the
    # cache could not take at the time; later an identical block sits in the cache,
    # evictable. Switching the child to it would take a block reservations count on while
    # the parent keeps the duplicate: the child stays private instead.
    mgr = BlockManager(10, 2, cache_capacity=1)
    x = make("x", [5, 5, 9])
    run_prompt(mgr, x)  # the cache's one slot: [5, 5], in use by x
    parent = make("p", [7, 7, 1])
    run_prompt(mgr, parent)  # [7, 7] cannot be cached: the slot is taken and in use
    assert mgr.tree.num_nodes == 1 and not mgr._chains["p"]
    child = make("c", [7, 7, 1])
    child.output_token_ids = list(parent.output_token_ids)
    mgr.fork(parent, child)  # the child shares the uncached [7, 7] block
    mgr.release(x)
    y = make("y", [7, 7, 3])
    run_prompt(mgr, y)  # evicts [5, 5]; caches y's own [7, 7]
    mgr.release(y)  # ... which is now evictable
    free, evictable = mgr.pool.num_free, mgr.tree.num_evictable
    promised = make("r", [9], max_tokens=2 * (free + evictable) - 1)
    mgr.admit(promised, 1, reserve_full=True)  # reserves every block left
    assert mgr.num_reserved == mgr.pool.num_free + mgr.tree.num_evictable
    mgr.cache_computed(child)
    mgr.check_integrity()
    shared = mgr.tables["p"][0]
    assert mgr.tables["c"][0] == shared and mgr.pool.refcount[shared] == 2
    mgr.release(promised)
    mgr.cache_computed(child)  # with room again, the child switches to the cached block
    assert mgr.tables["c"][0] != shared
    mgr.check_integrity()


def test_fork_shares_only_the_blocks_that_hold_computed_tokens() -> None:
    mgr = BlockManager(8, 4)
    parent = make("p", list(range(10)))
    mgr.admit(parent, 10, reserve_full=False)  # 3 blocks allocated, none computed yet
    parent.num_computed_tokens = 5
    child = make("c", list(range(10)))
    mgr.fork(parent, child)
    # Blocks 0-1 hold the 5 computed tokens; block 2 is the parent's, for tokens to come.
    assert mgr.tables["c"] == mgr.tables["p"][:2]
    mgr.check_integrity()


# One write each: (what, which entry — None for the attribute itself, "+" to append —, the
# value, what the check must say). The state written to: a's table [0, 1, 2], b's [0, 1, 3]
# (b reuses a's two full blocks through the prefix cache), blocks 4–15 free, no host block
# in use.
CORRUPTIONS = [
    ("pool.refcount", 3, -1, "block 3 has negative refcount -1"),
    ("pool.cached", 15, 1, "block 15 is cached but unreferenced"),
    ("pool.states", 15, 2, "block 15: state 2 disagrees with refcount 0"),
    ("pool.refcount", 3, 2, "block 3: state 1 disagrees with refcount 2"),
    ("pool.num_free", None, 11, "free count disagrees"),
    ("pool.num_cached_only", None, 1, "evictable count 1 != actual 0"),
    ("pool._free", "+", 4, "a block is on the free list twice"),
    ("pool._free", 0, 2, "a referenced block is on the free list"),
    ("pool.refcount", 0, 5, "block 0: refcount 5 but 3 references"),
    ("tables.b", 2, 15, "block 3: refcount 1 but 0 references"),  # 3 lost its entry
    ("tables.b", "+", -1, "a table ends in a hole"),
    ("tables.b", 2, 16, "a table names a block past the pool's end"),
    ("host._free", "+", 0, "a host block is on the free list twice"),
    ("host.states", 0, 1, "host block 0: its state and the free list disagree"),
]


def corrupt(mgr: BlockManager, where: str, entry, value) -> None:
    *path, last = where.split(".")
    owner = mgr
    for name in path:
        owner = getattr(owner, name)
    if entry is None:
        setattr(owner, last, value)
        return
    target = owner[last] if isinstance(owner, dict) else getattr(owner, last)
    if entry == "+":
        target.append(value)
    else:
        target[entry] = value


@pytest.mark.parametrize(("where", "entry", "value", "message"), CORRUPTIONS)
def test_integrity_names_each_broken_invariant(where, entry, value, message) -> None:
    """The check can fail: one wrong value in the pool's counts, flags, states or free
    list, a request's table or the host tier is found and named."""
    mgr = BlockManager(16, 4, host_blocks=4)
    for rid in ("a", "b"):
        run_prompt(mgr, make(rid, list(range(10))))
    assert mgr.tables == {"a": [0, 1, 2], "b": [0, 1, 3]}
    corrupt(mgr, where, entry, value)
    with pytest.raises(AssertionError, match=re.escape(message)):
        mgr.check_integrity()

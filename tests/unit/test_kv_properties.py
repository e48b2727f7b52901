"""Random operation sequences against BlockManager + PrefixTree, checking integrity each step."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.kv.manager import BlockManager

# A tiny alphabet so random prompts share prefixes and the cache gets hits.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class KVMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.mgr = BlockManager(24, 4, cache_capacity=0, clock=lambda: self.now)
        self.ids = itertools.count()
        self.live: dict[str, Request] = {}

    def _tick(self) -> None:
        self.now += 1.0

    @rule(target=requests, prompt=tokens, max_tokens=st.integers(1, 8), full=st.booleans(),
          chunk=st.integers(1, 16))
    def admit(self, prompt, max_tokens, full, chunk):
        self._tick()
        req = Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=max_tokens))
        chunk = min(chunk, len(prompt))
        if not self.mgr.can_admit(req, chunk, full):
            return None
        hit = self.mgr.peek_prefix(req)
        self.mgr.admit(req, min(chunk, len(prompt) - hit), full)
        assert req.num_computed_tokens == hit < len(prompt)
        self.live[req.request_id] = req
        return req.request_id

    def _req(self, rid):
        return self.live.get(rid) if rid is not None else None

    @rule(rid=requests, k=st.integers(1, 6), token=st.integers(0, 2))
    def compute(self, rid, k, token):
        """Compute up to k pending tokens; when all are computed, sample one more."""
        req = self._req(rid)
        if req is None:
            return
        self._tick()
        k = min(k, req.num_pending_tokens)
        if not self.mgr.can_allocate(req, k):  # growth or a copy-on-write may need a block
            return
        cows = self.mgr.allocate(req, k)
        held = self._tables(rid)
        for src, dst in cows:
            assert self.mgr.pool.refcount[dst] == 1
            assert sum(t.count(dst) for t in held) == 1
            assert not any(src in t for t in held)
        req.num_computed_tokens += k
        if req.num_pending_tokens == 0:
            req.output_token_ids.append(token)
        self.mgr.cache_computed(req)
        self._computed(req)

    def _tables(self, rid) -> list[list[int]]:
        """Every table of `rid` a copy-on-write may write into."""
        return [self.mgr.table(rid)]

    def _computed(self, req) -> None:
        """Hook: `req` just computed tokens."""

    @rule(target=requests, rid=requests)
    def fork(self, rid):
        req = self._req(rid)
        if req is None:
            return None
        child = Request(f"r{next(self.ids)}", list(req.prompt_token_ids),
                        req.sampling, output_token_ids=list(req.output_token_ids))
        self.mgr.fork(req, child)
        self.live[child.request_id] = child
        return child.request_id

    @rule(rid=requests, data=st.data())
    def truncate(self, rid, data):
        req = self._req(rid)
        if req is None or req.num_computed_tokens == 0:
            return
        n = data.draw(st.integers(0, req.num_computed_tokens))
        self.mgr.truncate(req, n)
        assert req.num_computed_tokens == n
        # Drop output tokens past n so the request's tokens match its KV again.
        keep_out = max(0, n - req.num_prompt_tokens)
        del req.output_token_ids[keep_out:]
        if n < req.num_prompt_tokens:
            req.num_computed_tokens = n

    @rule(rid=consumes(requests), in_flight=st.booleans())
    def release(self, rid, in_flight):
        req = self._req(rid)
        if req is None:
            return
        self._tick()
        if in_flight:
            self.mgr.begin_step()
            used = set(self.mgr.table(rid))
            self.mgr.release(req)
            # Blocks read by the in-flight step are not reusable until it ends.
            assert all(self.mgr.pool.refcount[b] > 0 for b in used)
            self.mgr.end_step()
        else:
            self.mgr.release(req)
        assert rid not in self.mgr.tables
        del self.live[rid]

    @rule()
    def evict(self):
        before = self.mgr.tree.num_evictable
        freed = self.mgr.tree.evict_one()
        assert (freed is None) == (before == 0)

    @precondition(lambda self: self.mgr.tree.num_nodes > 0)
    @rule(cap=st.integers(0, 8), policy=st.sampled_from(["lru", "value"]))
    def reconfigure(self, cap, policy):
        self.mgr.configure_cache(True, cap, policy)

    @invariant()
    def integrity(self):
        self.mgr.check_integrity()

    def teardown(self):
        for req in list(self.live.values()):
            self.mgr.release(req)
        self.mgr.check_integrity()
        # Only cached blocks remain in use, then none after a cache clear.
        assert self.mgr.pool.num_used == self.mgr.tree.num_nodes
        self.mgr.clear_cache()
        self.mgr.check_integrity()
        assert self.mgr.pool.num_free == self.mgr.num_blocks
        assert self.mgr.num_reserved == 0


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase


class HostTierMachine(KVMachine):
    """The same operations with a host tier: swaps out and back, demotions by eviction,
    host hits on admission, and the tier dropped as a KV format change drops it. Device and
    host block counts must add up after every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockManager(24, 4, cache_capacity=0, clock=lambda: self.now,
                                host_blocks=10, link_seconds=lambda nbytes: 1e-6 * nbytes)
        self.swapped: dict[str, Request] = {}

    @rule(rid=KVMachine.requests)
    def swap_out(self, rid):
        req = self._req(rid)
        if req is None or not self.mgr.swaps.can_swap_out(
                self.mgr.blocks_needed(req.num_computed_tokens)):
            return
        self._tick()
        table = list(self.mgr.table(rid))
        computed = req.num_computed_tokens
        n = self.mgr.swaps.swap_out(req)
        assert rid not in self.mgr.tables and len(self.mgr.host_tables[rid]) == n
        (kind, direction, what, pairs), = [c for c in self.mgr.take_copies() if c[0] == "swap"]
        assert (kind, direction, what) == ("swap", "d2h", rid)
        assert [p[0] for p in pairs] == table[:n]  # the computed blocks, in table order
        assert req.num_computed_tokens == computed
        self.swapped[rid] = self.live.pop(rid)

    @rule(full=st.booleans())
    def swap_in(self, full):
        if not self.swapped:
            return
        rid, req = next(iter(self.swapped.items()))
        if not self.mgr.swaps.can_swap_in(req, 1, full):
            return
        self._tick()
        hosts = list(self.mgr.host_tables[rid])
        computed = req.num_computed_tokens
        self.mgr.swaps.swap_in(req, 0, full)
        copies = [c for c in self.mgr.take_copies() if c[0] == "swap"]
        assert copies[-1][1] == "h2d" and [p[0] for p in copies[-1][3]] == hosts
        assert [p[1] for p in copies[-1][3]] == self.mgr.table(rid)[:len(hosts)]
        assert req.num_computed_tokens == computed and rid not in self.mgr.host_tables
        self.live[rid] = self.swapped.pop(rid)

    @rule()
    def drop_swapped(self):
        if self.swapped:
            rid, req = self.swapped.popitem()
            self.mgr.release(req)  # an abort while swapped out frees its host copy
            assert rid not in self.mgr.host_tables

    @rule(demote=st.booleans())
    def demote_setting(self, demote):
        self.mgr.configure_cache(True, self.mgr.tree.capacity, self.mgr.tree.policy, demote)

    @rule(blocks=st.integers(0, 12))
    def drop_host_tier(self, blocks):
        for rid in self.mgr.swaps.drop_host_tier(blocks):
            req = self.swapped.pop(rid)
            req.num_computed_tokens = 0
        assert self.mgr.host.num_used == 0 and self.mgr.host.num_blocks == blocks

    @invariant()
    def tiers_add_up(self):
        mgr = self.mgr
        assert mgr.pool.num_free + mgr.pool.num_used == mgr.num_blocks
        host = mgr.host
        assert host.num_free + host.num_swapped + host.num_demoted == host.num_blocks
        assert host.num_swapped == sum(len(t) for t in mgr.host_tables.values())
        assert host.num_demoted == len(mgr.tree.host_nodes)
        mgr.take_copies()

    def teardown(self):
        for req in self.swapped.values():
            self.mgr.release(req)
        assert self.mgr.host.num_swapped == 0
        super().teardown()
        assert self.mgr.host.num_used == 0  # clearing the cache drops demoted blocks too


HostTierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50,
                                             deadline=None)
TestHostTierMachine = HostTierMachine.TestCase


def test_long_random_sequences_over_both_tiers_keep_every_count() -> None:
    """A seeded random walk long enough that every host-tier path happens many times — swap
    out and in, demotion by eviction, host hits on admission, a swapped request dropped,
    the tier re-laid — with integrity and the tiers' counts checked after every operation."""
    import random

    rng = random.Random(3)
    mgr = BlockManager(40, 4, host_blocks=16, link_seconds=lambda nbytes: 1e-9 * nbytes)
    live: dict[str, Request] = {}
    swapped: dict[str, Request] = {}
    prompts = [[rng.randrange(3) for _ in range(20)] for _ in range(6)]
    ids = itertools.count()
    for _ in range(4000):
        op = rng.random()
        if op < 0.25:
            base = rng.choice(prompts)
            req = Request(f"r{next(ids)}", base[:rng.randrange(5, 21)] +
                          [rng.randrange(3) for _ in range(rng.randrange(1, 6))],
                          SamplingParams(max_tokens=4))
            hit = mgr.peek_prefix(req)
            n = req.num_prompt_tokens - hit
            if mgr.can_admit(req, n, False):
                mgr.admit(req, n, False)
                req.num_computed_tokens += n
                mgr.cache_computed(req)
                live[req.request_id] = req
        elif op < 0.4 and live:
            req = live.pop(rng.choice(sorted(live)))
            mgr.release(req)
        elif op < 0.55 and live:
            rid = rng.choice(sorted(live))
            req = live[rid]
            if mgr.swaps.can_swap_out(mgr.blocks_needed(req.num_computed_tokens)):
                mgr.swaps.swap_out(req)
                swapped[rid] = live.pop(rid)
        elif op < 0.7 and swapped:
            rid = rng.choice(sorted(swapped))
            req = swapped[rid]
            if mgr.swaps.can_swap_in(req, 0, False):
                mgr.swaps.swap_in(req, 0, False)
                live[rid] = swapped.pop(rid)
        elif op < 0.85:
            mgr.tree.evict_one()
        elif op < 0.88 and swapped:
            mgr.release(swapped.pop(rng.choice(sorted(swapped))))
        elif op < 0.885:
            for rid in mgr.swaps.drop_host_tier(rng.choice((16, 12))):
                req = swapped.pop(rid)
                req.num_computed_tokens = 0
                mgr.release(req)
        mgr.take_copies()
        mgr.check_integrity()
        host = mgr.host
        assert host.num_free + host.num_swapped + host.num_demoted == host.num_blocks
        assert mgr.pool.num_free + mgr.pool.num_used == mgr.num_blocks
    tree = mgr.tree
    assert mgr.num_swap_outs > 50 and mgr.num_swap_ins > 50
    assert tree.num_demotions > 50 and tree.num_promotions > 10
    assert tree.num_host_hit_tokens == 4 * tree.num_promotions

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

from runtime.kv.manager import BlockManager
from runtime.request import Request, SamplingParams

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
        for src, dst in cows:
            assert self.mgr.pool.refcount[dst] == 1 and self.mgr.tables[rid].count(dst) == 1
            assert src not in self.mgr.tables[rid]
        req.num_computed_tokens += k
        if req.num_pending_tokens == 0:
            req.output_token_ids.append(token)
        self.mgr.cache_computed(req)

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
            used = set(self.mgr.tables[rid])
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

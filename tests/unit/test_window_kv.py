"""Sliding-window block tables (`free_window_kv`): freeing behind the window, prefix hits cut
to where the window is cached, forks, and random operation sequences with integrity
checked after every step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.kv.groups import LayerGroups, layer_groups
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.kv.prefix_node import block_keys
from tests.unit.test_kv_properties import KVMachine

# 3 full-attention and 5 local layers: pages of 3 layers, a window block is 2 pages.
GROUPS = LayerGroups(8, (0, 1, 3, 4, 6), window=8)


def manager(num_pages: int = 64, **kw) -> BlockManager:
    return BlockManager(num_pages, 4, groups=GROUPS, **kw)


def run(mgr: BlockManager, req: Request, chunk: int) -> None:
    """Compute `req`'s prompt `chunk` tokens a step, freeing behind the window after each."""
    mgr.admit(req, min(chunk, req.num_tokens - req.num_computed_tokens), False)
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        mgr.allocate(req, n)
        req.num_computed_tokens += n
        mgr.cache_computed(req)
        mgr.slide(req)
        mgr.check_integrity()


def test_layout_of_gemma3():
    g = layer_groups(18, tuple(i for i in range(18) if (i + 1) % 6), 512, "gemma3")
    assert g.page_layers == 3 and g.pages_per_local_block == 5
    assert g.place(5) == (-1, 0) and g.place(17) == (-1, 2)
    assert g.place(0) == (0, 0) and g.place(4) == (1, 1) and g.place(16) == (4, 2)
    # 8K tokens computed: 512 full-attention pages; the next query reads 7,681 on, blocks
    # 480..511, 32 window blocks of 5 pages.
    assert g.pages_held(8192, 16) == (512, 32 * 5)
    assert 6 * 512 / (512 + 160) > 4.5


def test_groups_refuse_models_without_a_mix():
    for local in ((), tuple(range(4))):
        try:
            layer_groups(4, local, 8 if local else None, "m")
        except Exception as e:
            assert "free_window_kv needs a model" in str(e)
        else:
            raise AssertionError("a model without a mix of layers was accepted")


def test_window_blocks_behind_the_window_are_freed():
    mgr = manager(enable_caching=False)
    req = Request("a", list(range(40)), SamplingParams(max_tokens=4))
    run(mgr, req, 6)
    wt = mgr.window_tables["a"]
    # Next position 40: the window reads 33..40, so blocks 0..7 (tokens 0..31) are free.
    assert [t[:8] for t in wt] == [[-1] * 8] * 2
    assert all(p >= 0 for t in wt for p in t[8:])
    full, window = mgr.window_counts()
    assert (full, window) == GROUPS.pages_held(40, 4) == (10, 4)
    assert mgr.pool.num_used == 10 + 4
    mgr.release(req)
    mgr.check_integrity()
    assert mgr.pool.num_free == mgr.num_blocks


def test_prefix_hit_needs_the_cached_window_before_it():
    mgr = manager()
    prompt = list(range(33))
    a = Request("a", prompt, SamplingParams(max_tokens=1))
    run(mgr, a, 8)
    mgr.release(a)
    mgr.check_integrity()
    # Every full block of a's prompt is cached with its window pages.
    assert all(n.local for n in mgr.tree.nodes.values())
    b = Request("b", prompt + [99], SamplingParams(max_tokens=1))
    assert mgr.peek_prefix(b) == 32
    # Without the window pages of block 6 a hit at depth 8 (or 7) would read them: the
    # deepest usable hit ends at block 6.
    chain = mgr.tree.match(mgr.namespace, block_keys(prompt, mgr.block_size))
    node6 = chain[6]
    mgr.tree.drop_local(node6)
    mgr.check_integrity()
    assert mgr.peek_prefix(b) == 24
    mgr.admit(b, 10, False)
    assert b.num_computed_tokens == 24
    # The hit brings the window before it (blocks 4 and 5), not the blocks behind it.
    assert [t[:6] for t in mgr.window_tables["b"]] == \
        [[-1] * 4 + [n.local[t] for n in chain[4:6]]
         for t in range(2)]
    mgr.check_integrity()


def test_window_pages_are_evicted_oldest_release_first():
    mgr = manager(num_pages=40)
    a = Request("a", list(range(40)), SamplingParams(max_tokens=1))
    run(mgr, a, 8)
    # a's early window pages were released as it moved on: only the cache holds them.
    before = mgr.tree.num_evictable
    assert before == sum(len(n.local) for n in mgr.tree.nodes.values()
                         if mgr.pool.refcount[n.local[0]] == 1) > 0 if before else True
    oldest = next(iter(mgr.tree._local_free))
    assert oldest.node_id == min(n.node_id for n in mgr.tree._local_free)
    b = Request("b", [7] * 40, SamplingParams(max_tokens=1))
    assert mgr.can_admit(b, 8, False)
    run(mgr, b, 8)  # needs pages: evicts released window pages, a's running ones stay
    assert mgr.window_tables["a"][0][-1] >= 0
    mgr.check_integrity()


def test_fork_shares_window_pages_and_copies_the_tail_on_write():
    mgr = manager(enable_caching=False)
    a = Request("a", list(range(30)), SamplingParams(max_tokens=4))
    run(mgr, a, 10)
    child = Request("c", list(range(30)), SamplingParams(max_tokens=4))
    mgr.fork(a, child)
    assert mgr.window_tables["c"] == mgr.window_tables["a"]
    mgr.check_integrity()
    a.output_token_ids.append(1)
    cows = mgr.allocate(a, 1)
    # Block 7 (tokens 28..31) is shared and partial: full page + 2 window pages copied.
    assert len(cows) == 3
    assert mgr.window_tables["a"][0][7] != mgr.window_tables["c"][0][7]
    mgr.check_integrity()


class WindowMachine(KVMachine):
    """The random operations of `KVMachine` on a manager with layer groups; every
    computation frees behind the window."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockManager(60, 4, cache_capacity=0, clock=lambda: self.now,
                                groups=GROUPS)

    def _tables(self, rid) -> list[list[int]]:
        return [self.mgr.table(rid), *self.mgr.window_tables.get(rid, ())]

    def _computed(self, req) -> None:
        self.mgr.slide(req)

    @rule(rid=KVMachine.requests, data=st.data())
    def truncate(self, rid, data):
        req = self._req(rid)
        if req is None or req.num_computed_tokens == 0:
            return
        # A rollback never returns behind the freed window (speculation rolls back only
        # what one step computed).
        start = self.mgr.state.window_start[rid] * 4
        low = min(start + GROUPS.window, req.num_computed_tokens)
        n = data.draw(st.integers(low, req.num_computed_tokens))
        self.mgr.truncate(req, n)
        keep_out = max(0, n - req.num_prompt_tokens)
        del req.output_token_ids[keep_out:]

    def teardown(self):
        for req in list(self.live.values()):
            self.mgr.release(req)
        self.mgr.check_integrity()
        self.mgr.clear_cache()
        self.mgr.check_integrity()
        assert self.mgr.pool.num_free == self.mgr.num_blocks


WindowMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40,
                                           deadline=None)
test_window_machine = WindowMachine.TestCase

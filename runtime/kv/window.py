"""Sliding-window block tables: the `BlockManager`'s second layer group (`free_window_kv`).

With layer groups (`kv/groups.py`) every request has, beside its full-attention table (one
page per block, `KVState.tables`), one table per sliding-window sub-group
(`KVState.window_tables[rid][t]`, one page per block, −1 where freed). `WindowTables` makes
the decisions about them (what a hit brings, when a page is freed, copy-on-write of a
fork's tail) and changes them by applying `WinRef`, `WinUnref` and `WinCache` events. All
of them draw pages from the one pool, so capacity is shared and counted in pages: a new
block costs one page for the full-attention layers and `pages_per_local_block` for the
window.

After every step (`slide`) a request's window pages for blocks entirely behind
`q − w + 1` are released, `q` being the next position it will compute: no query it can still
schedule reads them (a speculative rollback only ever returns to a position computed in the
same step, after which this runs). A fork shares them; the prefix cache may keep them
(`PrefixTree.attach_local`), evictable on their own.

A prefix hit must bring the window before its end: a chain is cut to the deepest depth `d`
whose blocks `first_live_block(d·p) … d − 1` all have cached window pages; deeper cached
full-attention blocks are recomputed with the rest of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.kv.block_pool import CACHED_ACTIVE, PRIVATE, SHARED
from kvdeck.runtime.kv.events import WinCache, WinRef, WinUnref
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.prefix_node import PrefixNode
from kvdeck.runtime.kv.state import KVState

_HELD = bytes(1 if s in (PRIVATE, SHARED, CACHED_ACTIVE) else 0 for s in range(256))


def held_by_group(states: bytes, page_groups: bytes) -> tuple[int, int]:
    """(full-attention pages, window pages) some request holds, from the packed block
    states and the group flags (one byte each per page): two big-integer operations instead
    of a pass over the pool in Python."""
    held = states.translate(_HELD)
    window = (int.from_bytes(held, "big") & int.from_bytes(page_groups, "big")).bit_count()
    return held.count(1) - window, window


class WindowTables:
    """The window-table decisions of one `BlockManager` (composed, not inherited): it reads
    `state` and changes it only through `apply` (the manager's, which applies the event to
    `state`); `take(rid, n)` hands out `n` free pages, counted against `rid`'s reservation.
    Every method is a no-op without layer groups."""

    def __init__(self, groups: LayerGroups | None, state: KVState,
                 take: Callable[[str, int], list[int]],
                 apply: Callable[[WinRef | WinUnref | WinCache], None]):
        self.groups = groups
        self.state = state
        self.take = take
        self.apply = apply
        self.block_size = state.block_size

    @property
    def local_pages(self) -> int:
        """Pages one window block takes (0 without layer groups)."""
        return self.groups.pages_per_local_block if self.groups else 0

    # -- prefix hits ------------------------------------------------------------------------

    def cut(self, chain: list[PrefixNode]) -> list[PrefixNode]:
        """The deepest prefix of `chain` whose window before its end is cached."""
        g = self.groups
        if g is None or not chain:
            return chain
        p = self.block_size
        missing = [k for k, node in enumerate(chain) if not node.local]
        d, i = len(chain), len(missing) - 1
        while d > 0:
            while i >= 0 and missing[i] >= d:
                i -= 1
            if i < 0 or missing[i] < g.first_live_block(d * p, p):
                return chain[:d]
            # Every depth from missing[i] + 1 to d reads block missing[i] (the first block
            # read only grows with the depth): the next candidate ends just before it.
            d = missing[i]
        return []

    def hit_evictable(self, chain: list[PrefixNode]) -> int:
        """Pages of `chain`'s window that only the cache holds (admission takes them)."""
        if not self.groups or not chain:
            return 0
        first = self.groups.first_live_block(len(chain) * self.block_size, self.block_size)
        rc = self.state.pool.refcount
        return sum(len(n.local) for n in chain[first:] if rc[n.local[0]] == 1)

    def admit(self, rid: str, chain: list[PrefixNode]) -> None:
        """A new request's window before its hit comes from the cache (−1 before that)."""
        d = len(chain)
        if not self.groups or not d:
            return
        apply = self.apply
        for k in range(self.groups.first_live_block(d * self.block_size, self.block_size), d):
            apply(WinRef(rid, k, list(chain[k].local)))

    # -- growth -----------------------------------------------------------------------------

    def tail_shared(self, req: Request) -> bool:
        wt = self.state.window_tables.get(req.request_id)
        n = req.num_computed_tokens
        if not wt or n % self.block_size == 0 or not wt[0]:
            return False
        page = wt[0][(n - 1) // self.block_size]
        return page >= 0 and self.state.pool.refcount[page] > 1

    def grow(self, req: Request, num_new_tokens: int, cows: list, num_old: int) -> int:
        """Give `req`'s window tables the blocks `allocate` gave its full table (it had
        `num_old`), copying a shared partial tail first (a fork's). Returns the pages
        copied."""
        rid, st = req.request_id, self.state
        copied = 0
        if num_new_tokens > 0 and self.tail_shared(req):
            wt = st.window_tables[rid]
            idx = (req.num_computed_tokens - 1) // self.block_size
            srcs = [table[idx] for table in wt]
            dsts = self.take(rid, len(wt))
            self.apply(WinRef(rid, idx, dsts))  # drops the shared pages
            cows.extend(zip(srcs, dsts, strict=True))
            copied = len(dsts)
        wt = st.window_tables.get(rid)
        have = len(wt[0]) if wt else num_old  # no table yet: everything before is behind
        for k in range(have, len(st.tables[rid])):
            self.apply(WinRef(rid, k, self.take(rid, self.local_pages)))
        return copied

    # -- sliding, caching, forks, truncation, release -----------------------------------------

    def slide(self, req: Request) -> None:
        """Release `req`'s window blocks behind the window of its next position."""
        rid, st = req.request_id, self.state
        wt = st.window_tables.get(rid)
        if wt is None:
            return
        first = min(self.groups.first_live_block(req.num_computed_tokens, self.block_size),
                    len(wt[0]))
        for k in range(st.window_start[rid], first):  # held from the start on
            self.apply(WinUnref(rid, k, [table[k] for table in wt]))

    def twin_cost(self, rid: str, k: int, twin: PrefixNode) -> int:
        """Evictable pages that adopting `twin`'s window pages for block `k` would take
        without freeing `rid`'s own (a fork still holds them)."""
        wt = self.state.window_tables.get(rid)
        if wt is None:
            return 0
        mine = wt[0][k]
        rc = self.state.pool.refcount
        if mine < 0 or not twin.local or rc[twin.local[0]] != 1 or rc[mine] == 1:
            return 0
        return len(twin.local)

    def cache(self, rid: str, k: int, node: PrefixNode) -> None:
        """Block `k` of `rid` is cached as `node`: the cache keeps the request's window
        pages with it, or the request switches to the node's own (a twin)."""
        wt = self.state.window_tables.get(rid)
        if wt is None:
            return
        mine = [table[k] for table in wt]
        if mine[0] < 0:
            return  # already behind its window (cached late, by cache admission)
        if not node.local:
            self.apply(WinCache(node.node_id, mine))
        elif mine != list(node.local):
            self.apply(WinRef(rid, k, list(node.local)))  # drops its own

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """`child` shares `parent`'s window pages of its first `num_blocks` blocks."""
        st = self.state
        wt = st.window_tables.get(parent.request_id)
        if wt is None:
            return
        cid = child.request_id
        for k in range(min(st.window_start[parent.request_id], num_blocks), num_blocks):
            self.apply(WinRef(cid, k, [table[k] for table in wt]))

    def truncate(self, rid: str, num_tokens: int) -> None:
        st = self.state
        wt = st.window_tables.get(rid)
        if wt is None:
            return
        assert self.groups.first_live_block(num_tokens, self.block_size) >= \
            st.window_start[rid], f"{rid} rolled back behind its freed window blocks"
        keep = -(-num_tokens // self.block_size)
        while len(wt[0]) > keep:  # all inside the window (the assertion above)
            self.apply(WinUnref(rid, len(wt[0]) - 1, [table[-1] for table in wt]))

    def release(self, rid: str) -> None:
        """Drop `rid`'s window pages, last first (its tables go with its block table)."""
        st = self.state
        wt = st.window_tables.get(rid)
        if wt is None:
            return
        for k in range(len(wt[0]) - 1, st.window_start[rid] - 1, -1):
            self.apply(WinUnref(rid, k, [table[k] for table in wt]))

    # -- views ------------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(full-attention pages, window pages) that requests hold now."""
        return held_by_group(self.state.pool.states, self.state.page_groups)

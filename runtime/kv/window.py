"""Sliding-window block tables: the `BlockManager`'s second layer group (`free_window_kv`).

With layer groups (`kv/groups.py`) every request has, beside its full-attention table (one
page per block, `BlockManager.tables`), one table per sliding-window sub-group
(`window_tables[rid][t]`, one page per block, −1 where freed). All of them draw pages from
the one pool, so capacity is shared and counted in pages: a new block costs one page for the
full-attention layers and `pages_per_local_block` for the window.

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

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.kv.block_pool import CACHED_ACTIVE, PRIVATE, SHARED
from kvdeck.runtime.kv.events import WinRef, WinUnref
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.prefix_tree import PrefixNode

_HELD = bytes(1 if s in (PRIVATE, SHARED, CACHED_ACTIVE) else 0 for s in range(256))


def held_by_group(states: bytes, page_groups: bytes) -> tuple[int, int]:
    """(full-attention pages, window pages) some request holds, from the packed block
    states and the group flags (one byte each per page): two big-integer operations instead
    of a pass over the pool in Python."""
    held = states.translate(_HELD)
    window = (int.from_bytes(held, "big") & int.from_bytes(page_groups, "big")).bit_count()
    return held.count(1) - window, window


def move_window_pages(window_tables: dict[str, list[list[int]]], page_groups: bytearray,
                      moves: dict[int, int], num_pages: int) -> bytearray:
    """Re-lay window tables and group flags after the pool moved pages (`old -> new`) and
    now has `num_pages` pages (a KV format switch); returns the new flags."""
    for tables in window_tables.values():
        for table in tables:
            table[:] = [moves.get(b, b) for b in table]
    for old, new in moves.items():
        page_groups[new] = page_groups[old]
    return (page_groups + bytearray(max(num_pages - len(page_groups), 0)))[:num_pages]


class WindowTables:
    """Window-table operations of `BlockManager` (a mixin: it reads the manager's pool,
    tree, events and reservations). Every method is a no-op without layer groups."""

    groups: LayerGroups | None
    window_tables: dict[str, list[list[int]]]
    _window_start: dict[str, int]
    page_groups: bytearray
    """Per page: 1 when a window table or a node's window pages hold it (the KV map draws
    the two groups apart); stale for free pages."""

    def _init_window(self, groups: LayerGroups | None, num_pages: int) -> None:
        self.groups = groups
        self.window_tables = {}
        self._window_start = {}
        """Per request: blocks before this index are freed (−1 in every sub-table)."""
        self.page_groups = bytearray(num_pages)

    @property
    def local_pages(self) -> int:
        """Pages one window block takes (0 without layer groups)."""
        return self.groups.pages_per_local_block if self.groups else 0

    # -- prefix hits ------------------------------------------------------------------------

    def window_cut(self, chain: list[PrefixNode]) -> list[PrefixNode]:
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

    def _window_hit_evictable(self, chain: list[PrefixNode]) -> int:
        """Pages of `chain`'s window that only the cache holds (admission takes them)."""
        if not self.groups or not chain:
            return 0
        first = self.groups.first_live_block(len(chain) * self.block_size, self.block_size)
        rc = self.pool.refcount
        return sum(len(n.local) for n in chain[first:] if rc[n.local[0]] == 1)

    def _window_admit(self, rid: str, chain: list[PrefixNode]) -> None:
        """A table per sub-group for a new request: the window before its hit from the
        cache, −1 before that."""
        b = self.local_pages
        d = len(chain)
        first = self.groups.first_live_block(d * self.block_size, self.block_size) if d else 0
        wt = self.window_tables[rid] = [[-1] * first for _ in range(b)]
        self._window_start[rid] = first
        for k in range(first, d):
            pages = chain[k].local
            for t, page in enumerate(pages):
                self.pool.incref(page)
                self.tree.on_block_used(page)
                wt[t].append(page)
            self.events.append(WinRef(rid, k, list(pages)))

    # -- growth -----------------------------------------------------------------------------

    def _window_tail_shared(self, req: Request) -> bool:
        wt = self.window_tables.get(req.request_id)
        n = req.num_computed_tokens
        if not wt or n % self.block_size == 0 or not wt[0]:
            return False
        page = wt[0][(n - 1) // self.block_size]
        return page >= 0 and self.pool.refcount[page] > 1

    def _window_grow(self, req: Request, num_new_tokens: int, cows: list) -> None:
        """Give `req`'s window tables the blocks `allocate` gave its full table, copying a
        shared partial tail first (a fork's)."""
        rid = req.request_id
        wt = self.window_tables[rid]
        if num_new_tokens > 0 and self._window_tail_shared(req):
            idx = (req.num_computed_tokens - 1) // self.block_size
            fresh = []
            for t in range(len(wt)):
                src, dst = wt[t][idx], self._take_for(rid)
                self.page_groups[dst] = 1
                wt[t][idx] = dst
                fresh.append(dst)
                self._drop(src)
                cows.append((src, dst))
            self.events.append(WinRef(rid, idx, fresh))
            self.num_cow_copies += len(fresh)  # pages copied, as replay counts a plan's
        target = len(self.tables[rid])
        while len(wt[0]) < target:
            pages = [self._take_for(rid) for _ in wt]
            for t, page in enumerate(pages):
                self.page_groups[page] = 1
                wt[t].append(page)
            self.events.append(WinRef(rid, len(wt[0]) - 1, pages))

    # -- sliding, caching, forks, truncation, release -----------------------------------------

    def slide(self, req: Request) -> None:
        """Release `req`'s window blocks behind the window of its next position."""
        rid = req.request_id
        wt = self.window_tables.get(rid)
        if wt is None:
            return
        first = min(self.groups.first_live_block(req.num_computed_tokens, self.block_size),
                    len(wt[0]))
        start = self._window_start[rid]
        if first <= start:
            return
        assert not self.in_flight, "window blocks are released between steps"
        for k in range(start, first):  # held from `start` on (`_window_integrity`)
            pages = [table[k] for table in wt]
            for table in wt:
                table[k] = -1
            self.events.append(WinUnref(rid, k, pages))
            for page in pages:
                self._drop(page)
        self._window_start[rid] = first

    def _window_twin_cost(self, rid: str, k: int, twin: PrefixNode) -> int:
        """Evictable pages that adopting `twin`'s window pages for block `k` would take
        without freeing `rid`'s own (a fork still holds them)."""
        mine = self.window_tables[rid][0][k]
        rc = self.pool.refcount
        if mine < 0 or not twin.local or rc[twin.local[0]] != 1 or rc[mine] == 1:
            return 0
        return len(twin.local)

    def _window_cache(self, rid: str, k: int, node: PrefixNode) -> None:
        """Block `k` of `rid` is cached as `node`: the cache keeps the request's window
        pages with it, or the request switches to the node's own (a twin)."""
        wt = self.window_tables[rid]
        mine = [table[k] for table in wt]
        if mine[0] < 0:
            return  # already behind its window (cached late, by cache admission)
        if node.local:
            if mine == list(node.local):
                return
            for t, page in enumerate(node.local):
                self.pool.incref(page)
                self.tree.on_block_used(page)
                wt[t][k] = page
            self.events.append(WinRef(rid, k, list(node.local)))
            for page in mine:
                if page >= 0:
                    self._drop(page)
        elif mine[0] >= 0:
            self.tree.attach_local(node, mine, self.clock())

    def _window_fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        pid, cid = parent.request_id, child.request_id
        wt = self.window_tables[cid] = [table[:num_blocks] for table in
                                        self.window_tables[pid]]
        start = self._window_start[cid] = min(self._window_start[pid], num_blocks)
        for k in range(start, num_blocks):
            pages = [table[k] for table in wt]
            for page in pages:
                self.pool.incref(page)
                self.tree.on_block_used(page)
            self.events.append(WinRef(cid, k, pages))

    def _window_truncate(self, rid: str, num_tokens: int) -> None:
        wt = self.window_tables[rid]
        assert self.groups.first_live_block(num_tokens, self.block_size) >= \
            self._window_start[rid], f"{rid} rolled back behind its freed window blocks"
        keep = -(-num_tokens // self.block_size)
        while len(wt[0]) > keep:
            self._window_pop(rid, wt)

    def _window_pop(self, rid: str, wt: list[list[int]]) -> None:
        pages = [table.pop() for table in wt]
        if pages[0] >= 0:
            self.events.append(WinUnref(rid, len(wt[0]), pages))
            for page in pages:
                self._drop(page)

    def _window_release(self, rid: str) -> None:
        wt = self.window_tables.pop(rid, None)
        if wt is None:
            return
        while wt[0]:
            self._window_pop(rid, wt)
        self._window_start.pop(rid, None)

    # -- views and checks -------------------------------------------------------------------

    def window_counts(self) -> tuple[int, int]:
        """(full-attention pages, window pages) that requests hold now."""
        return held_by_group(self.pool.states, self.page_groups)

    def _window_integrity(self, counts: list[int]) -> None:
        """Add window-table references to `counts`; check the tables' shape."""
        for rid, wt in self.window_tables.items():
            n = len(self.tables[rid])
            start = self._window_start[rid]
            for table in wt:
                assert len(table) == n, f"{rid}: a window table differs in length"
                assert all(b < 0 for b in table[:start]), f"{rid}: a freed block is held"
                for b in table[start:]:
                    assert b >= 0, f"{rid}: a window block inside the window is missing"
                    counts[b] += 1
                    assert self.page_groups[b], f"page {b} held as a window page"

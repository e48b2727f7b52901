"""Block tables, reference counts, copy-on-write, reservation and prefix reuse.

`BlockManager` decides where every request's KV lives. It hands executors block tables
(read-only lists of physical block ids, one per `block_size` tokens) and copy-on-write
instructions; executors never decide placement.

The state itself is a `KVState` (`kv/state.py`): every decision here becomes a typed KV
event (`kv/events.py`: Ref, Unref, Cow, Cache, Evict, Hit, Reserve, ...) applied there, and
the same events in an iteration trace rebuild the block map, the prefix tree and every
block table without a model, through the same `apply`.

Blocks referenced by a step that is still executing are not reused: a release while
`in_flight` is set is deferred until `end_step()`.

With a host tier (`kv/tiers.py`, `host_blocks > 0`) a preempted request's computed blocks
can be swapped out and back (`swaps`, `kv/swaps.py`), and the prefix tree demotes evicted
blocks there and promotes them on a hit. Every copy between the tiers is queued in `copies`
in the order it was decided — `(kind, direction, what, [[src, dst], ...])` — and the
scheduler hands them to the executor with the next plan, which performs them in that order
before the plan's copy-on-write copies and its forward pass: a device block freed by a swap
or a demotion may be handed to another request in the same plan, so its bytes must leave
before anything writes it, and a host block freed by a swap-in or promotion may be taken by
a demotion decided after it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.kv import events as ev
from kvdeck.runtime.kv.block_pool import BlockPool
from kvdeck.runtime.kv.cache_admission import CacheAdmission
from kvdeck.runtime.kv.eviction import Eviction, TokenEvictor
from kvdeck.runtime.kv.formats import blocks_for_tokens
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.prefix_node import PrefixNode, default_recompute_cost
from kvdeck.runtime.kv.state import Figure, KVState
from kvdeck.runtime.kv.swaps import HostSwaps
from kvdeck.runtime.kv.window import WindowTables

_NO_BLOCKS: list[int] = []
"""The table of a request holding no block (never written: tables change by events)."""


class BlockManager:
    """Paged KV decisions for one engine. With layer groups (`groups`, `kv/window.py`)
    its blocks are pages and each request also has sliding-window tables."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 cache_capacity: int = 0, eviction_policy: str = "lru",
                 namespace: str = "default", bytes_per_block: int = 1,
                 recompute_cost: Callable[[int, int], float] = default_recompute_cost,
                 clock: Callable[[], int] = lambda: 0, host_blocks: int = 0,
                 link_seconds: Callable[[int], float] = lambda nbytes: 0.0,
                 groups: LayerGroups | None = None, eviction: Eviction = Eviction()):
        """`host_blocks`: the host tier's size in blocks (0: none); `link_seconds`: time
        to copy that many bytes one way between device and host (the measured link);
        `groups`: free sliding-window KV (`num_blocks` are then pages; no host tier);
        `eviction`: token-level KV eviction (`kv/eviction.py`; no groups, no host tier)."""
        assert groups is None or not host_blocks, "window pages have no host tier"
        self.block_size = block_size
        self.copies: list = []
        """Pending copies between the tiers, in order (see the module docstring)."""
        self.state = st = KVState(
            BlockPool(num_blocks, block_size), host_blocks=host_blocks, groups=groups,
            clock=clock, namespace=namespace, cache_capacity=cache_capacity,
            eviction_policy=eviction_policy, recompute_cost=recompute_cost,
            bytes_per_block=bytes_per_block, link_seconds=link_seconds, copies=self.copies)
        self.apply = st.apply
        # The state's parts, read (never written) by the scheduler, views and tests.
        self.pool, self.tree, self.host, self.groups = st.pool, st.tree, st.host, groups
        self.tables, self.host_tables = st.tables, st.host_tables
        self.window_tables, self.reserved = st.window_tables, st.reserved
        self.window = WindowTables(groups, st, self._take_for, self._apply)
        self.local_pages = self.window.local_pages
        self.enable_caching = enable_caching
        self.clock = clock
        """The engine's step number: the prefix tree's notion of recency."""
        self._chains: dict[str, list[PrefixNode]] = {}
        """Per request, the tree nodes backing its leading full blocks."""
        self.in_flight = False
        self._deferred: list[str] = []
        self.num_cow_copies = 0
        self.num_resets = 0
        self.link_seconds = link_seconds
        self.admission = CacheAdmission()
        """Which completed blocks may enter the prefix cache (`cache_admission.py`)."""
        assert not eviction.on or (groups is None and not host_blocks), \
            "token-level eviction has no window pages and no host tier"
        self.eviction = TokenEvictor(eviction, st, self._apply)
        self.swaps = HostSwaps(self)
        """Swapping to the host tier and back (`kv/swaps.py`)."""

    # -- the state's figures ----------------------------------------------------------------

    def table(self, rid: str) -> list[int]:
        """`rid`'s block table; empty when it holds no block (the first Ref makes it)."""
        return self.tables.get(rid, _NO_BLOCKS)

    num_reserved = Figure("state")
    namespace = Figure("state")
    bytes_per_block = Figure("state")
    page_groups = Figure("state")
    num_swap_outs = Figure("state")
    num_swap_ins = Figure("state")

    def _apply(self, event: ev.KVEvent) -> None:
        """Apply a decision; a lowered capacity then evicts what became evictable."""
        st = self.state
        st.apply(event)
        if st.released:
            st.released = False
            self._shrink_to_capacity()

    # -- knobs ------------------------------------------------------------------------------

    def configure_cache(self, enable: bool, capacity: int, policy: str,
                        demote: bool = True, admit_k: int = 1, admit_window: int = 1024
                        ) -> None:
        """Apply prefix-cache knobs; shrinking capacity or disabling evicts what it can."""
        self.admission.configure(admit_k, admit_window)
        self.enable_caching = enable
        self.tree.capacity = capacity
        self.tree.policy = policy
        self.tree.demote = demote
        if not demote:
            self.tree.drop_host()
        if not enable:
            self.tree.clear()
        else:
            self._shrink_to_capacity()

    def relayout(self, num_blocks: int, bytes_per_block: int, namespace: str
                 ) -> dict[int, int]:
        """Re-lay the pool as `num_blocks` blocks of `bytes_per_block` bytes whose cached
        KV is filed under `namespace` (a KV format change: the executor re-encodes them).

        Used blocks keep their ids where they fit; those beyond a smaller pool move to the
        lowest free ids. The caller first frees enough (`pool.num_used <= num_blocks`).
        Returns where every used block now is (`old -> new`, identity for most)."""
        pool = self.pool
        assert not self.in_flight, "the pool is re-laid only between steps"
        assert pool.num_used <= num_blocks, "the pool holds more blocks than the new layout"
        used = [b for b in range(pool.num_blocks) if pool.refcount[b]]
        free_low = (b for b in range(min(num_blocks, pool.num_blocks)) if not pool.refcount[b])
        moves = {b: next(free_low) for b in used if b >= num_blocks}
        self.apply(ev.Relayout(num_blocks, bytes_per_block, [[a, b] for a, b in moves.items()]),
                   namespace)
        return {b: moves.get(b, b) for b in used}

    # -- capacity ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def has_host_tier(self) -> bool:
        return self.host.num_blocks > 0

    def take_copies(self) -> list:
        """The pending tier copies, in order (the scheduler puts them in the next plan)."""
        out = self.copies[:]
        self.copies.clear()
        return out

    def num_available_blocks(self) -> int:
        """Blocks a new allocation could get: free + evictable − promised to reservations."""
        return self.pool.num_free + self.tree.num_evictable - self.state.num_reserved

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def pages_for(self, num_tokens: int, chunk_size: int, reserve_full: bool = False) -> int:
        """Pages one request of `num_tokens` tokens needs at its largest, computing
        `chunk_size` tokens a step: blocks, and with layer groups the window blocks it
        holds at once too (the window behind a chunk, and the chunk) — or, under full
        reservation, every window block, which is what `admit` promises."""
        blocks = self.eviction.bound(num_tokens, chunk_size)
        if not self.groups:
            return blocks
        if reserve_full:
            return blocks * (1 + self.local_pages)
        p, w = self.block_size, self.groups.window
        window = min(blocks, -(-(w - 1 + min(chunk_size, num_tokens)) // p) + 1)
        return blocks + window * self.local_pages

    # -- prefix reuse -----------------------------------------------------------------------

    @staticmethod
    def _reusable(req: Request) -> list[int]:
        """Tokens whose KV may come from the cache: all known tokens but the last, so the
        step that computes the last one yields logits (a preempted request's generated
        tokens count too). A request scoring its prompt (`prompt_logprobs`) needs the
        logits of every prompt position it has not scored yet, so it reuses none of
        those."""
        end = req.num_tokens - 1
        scored = req.num_prompt_scored
        return req.token_slice(0, end if scored is None else min(end, scored))

    def prefix_chain(self, req: Request) -> list[PrefixNode]:
        """The cached nodes an admission of `req` would reuse now (no side effects)."""
        return self._match(req, self._reusable(req)) if self.enable_caching else []

    def _match(self, req: Request, reusable: list[int]) -> list[PrefixNode]:
        """The cached chain `req` may reuse of its `reusable` tokens (none for a request long
        enough to evict its own KV: `TokenEvictor.shares_prefix`)."""
        if not self.eviction.shares_prefix(req):
            return []
        n, p = len(reusable) // self.block_size, self.block_size
        req.matched = self.tree.match(self.state.namespace_of(req), req.keys_of(n, p), n,
                                      req.matched)
        return self.window.cut(req.matched)

    def peek_prefix(self, req: Request) -> int:
        """Cached tokens an admission of `req` would reuse now (no side effects)."""
        return len(self.prefix_chain(req)) * self.block_size

    # -- admission and growth ---------------------------------------------------------------

    def can_admit(self, req: Request, num_new_tokens: int, reserve_full: bool,
                  chain: list[PrefixNode] | None = None) -> bool:
        """Whether `admit` would succeed without preempting anyone. `chain`: the result of
        `prefix_chain(req)` when the caller already has it."""
        if chain is None:
            chain = self.prefix_chain(req)
        hit = max(len(chain) * self.block_size, req.remote_kv_tokens)
        target = req.max_total_tokens if reserve_full else hit + num_new_tokens
        # Along a chain the used nodes come first (a request holds a whole chain), then the
        # cache-only device nodes, then the host ones (host residency is closed downwards):
        # each run is found by bisection.
        on_device = bisect_left(chain, True, key=lambda n: n.block < 0)
        # Demoted blocks in the chain are promoted into device blocks of their own.
        need = self.blocks_needed(target) - on_device
        if self.groups:
            need += (self.blocks_needed(target) - len(chain)) * self.local_pages
        available = self.num_available_blocks()
        if need > available:  # reusing the chain can only lower what is available
            return False
        # Reused blocks that are currently evictable stop being available once referenced.
        rc = self.pool.refcount
        used = bisect_left(chain, True, key=lambda n: rc[n.block] == 1, hi=on_device)
        evictable = on_device - used + self.window.hit_evictable(chain)
        return need <= available - evictable

    def admit(self, req: Request, num_new_tokens: int, reserve_full: bool) -> list[tuple[int, int]]:
        """Start (or restart) `req`: reuse its cached prefix, allocate the first chunk, and
        under full reservation promise blocks for `prompt + max_tokens − 1` tokens.

        Sets `req.num_computed_tokens` to the reused prefix. Callers check `can_admit` first.
        """
        rid = req.request_id
        assert rid not in self.tables, f"{rid} admitted twice"
        chain: list[PrefixNode] = []
        if self.enable_caching:
            reusable = self._reusable(req)
            chain = self._match(req, reusable)
            if self.admission.k > 1:
                p = self.block_size
                prompt = req.prompt_token_ids
                self.admission.on_admit(rid, self.state.namespace_of(req), [
                    tuple(prompt[i:i + p]) for i in range(0, len(prompt) - p + 1, p)],
                    first=req.admitted_time is None)
        # Pinned: no demotion decided while promoting may drop a block this chain needs.
        # (Its device nodes come first and are referenced before any promotion takes a
        # block, so no eviction can take them either.)
        self.tree.pin_host([n for n in chain if n.on_host])
        for i, node in enumerate(chain):
            if node.on_host:
                self._promote(rid, node)
            self.apply(ev.Ref(rid, i, node.block))
        self._chains[rid] = list(chain)  # grows as blocks are cached; `req.matched` not
        self.window.admit(rid, chain)
        hit = len(chain) * self.block_size
        req.num_computed_tokens = hit
        req.num_cached_tokens = hit
        if req.remote_kv_tokens > hit:  # computed elsewhere: fresh blocks hold it
            self._grow(req, req.remote_kv_tokens - hit, False)
            # Counted as cached, as vLLM counts tokens its KV connector brought.
            req.num_computed_tokens = req.num_cached_tokens = req.remote_kv_tokens
        req.remote_kv_tokens = 0
        if self.enable_caching:
            self.apply(ev.Hit(rid, hit), len(reusable))
        if reserve_full:
            # Window blocks are promised whole too: a conservative bound (they are freed
            # as the request moves on, and a freed page returns to the pool).
            self.apply(ev.Reserve(rid, (self.blocks_needed(req.max_total_tokens)
                                        - len(self.tables.get(rid, ())))
                                  * (1 + self.local_pages)))
        return self.allocate(req, num_new_tokens)

    def _promote(self, rid: str, node: PrefixNode) -> None:
        """Bring a demoted chain block back for `rid`'s admission (a host hit): a device
        block (the request's reference, which the caller applies next) receives its host
        copy."""
        (block,) = self._take_for(rid, 1)
        host_block = node.host_block
        self.apply(ev.Promote(node.node_id, host_block, block, 1))
        self.copies.append(("promote", "h2d", f"node {node.node_id}", [[host_block, block]]))

    def try_allocate(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """`allocate` if `can_allocate`, else None — one pass for the scheduler's hot loop:
        the tail's sharing and the blocks to add are worked out once.

        The common decode case (room left in an unshared tail block) touches nothing.
        """
        table = self.tables.get(req.request_id, _NO_BLOCKS)
        n = req.num_computed_tokens
        p = self.block_size
        shared = num_new_tokens > 0 and n % p != 0 and len(table) > 0 and \
            self.pool.refcount[table[(n - 1) // p]] > 1  # `_tail_is_shared`, inlined
        grow = -(-(n + num_new_tokens) // p) - len(table)
        if grow <= 0 and not shared and not (self.groups and self.window.tail_shared(req)):
            return []
        if self.groups:  # window tables have pages of their own: the general path
            return self.allocate(req, num_new_tokens) \
                if self.can_allocate(req, num_new_tokens) else None
        if max(grow, 0) + shared > self.num_available_blocks() + \
                self.reserved.get(req.request_id, 0):
            return None
        return self._grow(req, num_new_tokens, shared)

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Whether `req` can grow by `num_new_tokens` (counting its own reservation)."""
        need = self._new_blocks_needed(req, num_new_tokens)
        return need <= self.num_available_blocks() + self.reserved.get(req.request_id, 0)

    def _new_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        table = self.table(req.request_id)
        blocks = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(table)
        need = max(blocks, 0) * (1 + self.local_pages)
        if num_new_tokens > 0:  # copy-on-write of a shared partial tail
            need += self._tail_is_shared(req)
            if self.groups and self.window.tail_shared(req):
                need += self.local_pages
        return need

    def _tail_is_shared(self, req: Request) -> bool:
        table = self.tables.get(req.request_id)
        n = req.num_computed_tokens
        if n % self.block_size == 0 or not table:
            return False
        tail = table[(n - 1) // self.block_size]
        return self.pool.refcount[tail] > 1

    def allocate(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow `req`'s table to hold `num_computed + num_new_tokens` tokens.

        Returns copy-on-write pairs (src, dst) the executor must copy before writing: the
        first write into a shared, partially filled tail block copies it.
        """
        return self._grow(req, num_new_tokens, num_new_tokens > 0 and self._tail_is_shared(req))

    def _grow(self, req: Request, num_new_tokens: int, shared: bool) -> list[tuple[int, int]]:
        """`allocate`, told whether the tail block is shared (and written into)."""
        rid = req.request_id
        table = self.tables.get(rid)  # None: admitted without a hit, nothing held yet
        cows: list[tuple[int, int]] = []
        if shared:
            idx = (req.num_computed_tokens - 1) // self.block_size
            src = table[idx]
            (dst,) = self._take_for(rid, 1)
            self._apply(ev.Ref(rid, idx, dst))  # drops its reference to the shared one
            self.apply(ev.Cow(rid, src, dst))
            cows.append((src, dst))
            self.num_cow_copies += 1
        held = len(table) if table else 0
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        for i in range(held, need):  # block by block: evictions interleave as they fall due
            self.apply(ev.Ref(rid, i, self._take_for(rid, 1)[0]))
        if self.groups:
            self.num_cow_copies += self.window.grow(req, num_new_tokens, cows, held)
        return cows

    def _take_for(self, rid: str, n: int) -> list[int]:
        """`n` free blocks for `rid`, evicting cached ones to make room, drawn first from
        what was promised to it; the caller references them next, in this order."""
        promised = self.reserved.get(rid, 0)
        if promised:
            self.apply(ev.Reserve(rid, -min(promised, n)))
        pool = self.pool
        while pool.num_listed < n:
            freed = self.tree.evict_one()
            assert freed is not None, "no block to take (callers check the room first)"
        return pool.pick(n)

    def _shrink_to_capacity(self) -> None:
        """After the capacity knob was lowered below what running requests used, evict the
        excess as soon as it becomes evictable."""
        cap = self.tree.capacity
        while cap and self.tree.num_nodes > cap:
            if self.tree.evict_one(node_only=True) is None:
                break

    # -- caching computed blocks ------------------------------------------------------------

    def cache_computed(self, req: Request) -> None:
        """Insert `req`'s newly computed full blocks into the prefix tree.

        When the tree already holds identical content in another block, the request switches
        to the cached block and frees its duplicate, so shared prefixes are stored once.
        """
        if not self.enable_caching or not self.eviction.shares_prefix(req):
            return
        rid = req.request_id
        chain = self._chains[rid]
        p = self.block_size
        if req.num_computed_tokens // p <= len(chain):
            return  # no newly completed block (most decode steps)
        table = self.tables.get(rid, _NO_BLOCKS)
        full = min(req.num_computed_tokens // p, len(table))
        pool, st = self.pool, self.state
        window = self.groups is not None
        keys = req.keys_of(full, p)
        while len(chain) < full:
            k = len(chain)
            key = keys[k]
            parent = chain[-1] if chain else None
            twin = (parent or self.tree.root(st.namespace_of(req))).children.get(key)
            if twin is not None and twin.on_host and not window:
                # The same content was demoted: this block becomes its device copy (no
                # copy needed) and the host block is freed.
                self.apply(ev.Promote(twin.node_id, twin.host_block, table[k], 0))
                chain.append(twin)
                continue
            if twin is not None:
                # Switching to the cached twin takes its evictable blocks (and window pages)
                # without freeing ours while a fork still holds them: if that would break a
                # reservation's promise, stay private for now; a later call retries.
                cost = int(pool.refcount[twin.block] == 1 and pool.refcount[table[k]] > 1)
                if window:
                    cost += self.window.twin_cost(rid, k, twin)
                if cost and pool.num_free + self.tree.num_evictable - cost < st.num_reserved:
                    return
            if twin is None and not self.admission.allows(rid, k, key, st.namespace_of(req)):
                return  # not seen often enough yet (cache admission): stays private
            node = self.tree.insert(st.namespace_of(req), parent, key, table[k])
            if node is None:
                return  # at capacity with nothing evictable: stays private
            if node.block != table[k]:  # the twin: switch to its block, drop ours
                self._apply(ev.Ref(rid, k, node.block))
            if window:
                self.window.cache(rid, k, node)
            chain.append(node)

    # -- fork, truncate, release ------------------------------------------------------------

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` a table sharing the blocks that hold `parent`'s computed tokens (full
        blocks and the partial tail); the first write into the shared tail copies it.
        Blocks the parent allocated for tokens not computed yet stay the parent's."""
        src = self.table(parent.request_id)[:self.blocks_needed(parent.num_computed_tokens)]
        cid = child.request_id
        assert cid not in self.tables, f"{cid} already has a block table"
        for i, block in enumerate(src):
            self.apply(ev.Ref(cid, i, block))
        self._chains[cid] = list(self._chains.get(parent.request_id, []))
        child.num_computed_tokens = parent.num_computed_tokens
        self.eviction.fork(parent.request_id, cid)
        if self.groups:
            self.window.fork(parent, child, len(src))
            self.window.slide(child)  # the parent may not have slid past this step's blocks

    def evict_tokens(self, req: Request, scores: list[float] | None) -> None:
        """Token-level eviction after a step (`kv/eviction.py`; a no-op when off)."""
        self.eviction.after_step(req, scores)

    def slide(self, req: Request) -> None:
        """Release `req`'s window blocks behind the window of its next position (between
        steps)."""
        self.window.slide(req)

    def window_counts(self) -> tuple[int, int]:
        """(full-attention pages, window pages) that requests hold now."""
        return self.window.counts()

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Roll `req` back to its first `num_tokens` tokens, releasing whole blocks past them."""
        rid = req.request_id
        table = self.table(rid)
        keep = self.blocks_needed(num_tokens)
        if self.groups:
            self.window.truncate(rid, num_tokens)
        while len(table) > keep:
            self._unref_last(rid, table)
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)
        chain = self._chains[rid]
        del chain[num_tokens // self.block_size:]

    def _unref_last(self, rid: str, table: list[int]) -> None:
        self._apply(ev.Unref(rid, len(table) - 1, table[-1]))

    def release(self, req: Request) -> None:
        """Drop `req`'s table and reservation. Deferred while a step is in flight."""
        if self.in_flight:
            self._deferred.append(req.request_id)
            return
        self._release(req.request_id)

    def _release(self, rid: str) -> None:
        if rid in self.host_tables:  # swapped out: only the host copy is left
            self.apply(ev.Unswap(rid))
        self._release_device(rid)

    def _release_device(self, rid: str) -> None:
        """Drop `rid`'s device blocks (window pages first) and what it was promised."""
        table = self.table(rid)  # may hold none (rolled back to nothing) and still promise
        self.window.release(rid)
        while table:  # the last Unref removes the table
            self._unref_last(rid, table)
        promised = self.reserved.get(rid, 0)
        if promised:
            self.apply(ev.Reserve(rid, -promised))
        self._chains.pop(rid, None)
        self.admission.forget(rid)
        self.eviction.forget(rid)

    def begin_step(self) -> None:
        """An executor step that reads the current tables starts."""
        self.in_flight = True

    def end_step(self) -> None:
        """The step finished: releases requested meanwhile happen now."""
        self.in_flight = False
        deferred, self._deferred = self._deferred, []
        for rid in deferred:
            self._release(rid)

    def clear_cache(self) -> int:
        """Evict every cached block no request uses (`num_resets` counts the calls)."""
        self.num_resets += 1
        return self.tree.clear()

    def take_events(self) -> list[ev.KVEvent]:
        """The events applied since the last call."""
        return self.state.take_events()

    # -- views and checks -------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, as vLLM's `kv_cache_usage_perc` counts them:
        blocks only the prefix cache keeps are free for allocation and not counted."""
        return self.pool.num_held / self.pool.num_blocks

    def check_integrity(self) -> None:
        """Raise AssertionError unless the state holds together (`KVState.check_integrity`),
        every request's cached chain is its table's first blocks, and no more is promised
        than exists."""
        self.state.check_integrity()
        pool = self.pool
        for rid, table in self.tables.items():
            chain = self._chains.get(rid, [])
            assert len(chain) <= len(table)
            for i, node in enumerate(chain):
                assert table[i] == node.block, f"{rid} block {i} differs from its cached node"
        assert self.state.num_reserved <= pool.num_free + self.tree.num_evictable, \
            "more blocks promised than exist"
        assert pool.num_free + pool.num_used == pool.num_blocks

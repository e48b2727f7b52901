"""The KV state and the one function that changes it: `KVState.apply(event)`.

`KVState` owns everything a KV event changes: the pool's reference counts and block map
(`BlockStates`, or `BlockPool` with its free list), every request's block table (−1 where
token-level eviction left a hole, `kv/eviction.py`), its sliding-window tables
(`kv/window.py`), the host tier and the swapped requests' host tables, the reservations,
and the prefix tree's nodes. The live `BlockManager` decides
(which block to allocate, what to evict, when to copy on write or swap), builds the typed
event (`kv/events.py`) and applies it here; replay applies the recorded events with the same
function, so the two cannot drift apart. Nothing else writes these tables: code outside
reads them.

Events name what changes, not why. A few carry less than the live manager knows, because a
trace stores ids, not tokens; `apply`'s `extra` brings the rest: for `Cache` the parent node
and the block's tokens (replay files its nodes under one root by id), for `Hit` how many
tokens the lookup asked about, for `Relayout` the namespace the cached blocks now belong
to.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np

from kvdeck.runtime.kv.block_pool import BlockStates
from kvdeck.runtime.kv.events import (
    Cache,
    Cow,
    Demote,
    Drop,
    Evict,
    Hit,
    HostResize,
    KVEvent,
    Promote,
    Ref,
    Relayout,
    Reserve,
    SwapIn,
    SwapOut,
    Unref,
    Unswap,
    WinCache,
    WinEvict,
    WinRef,
    WinUnref,
)
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.prefix_checkpoint import export_tree, load_tree
from kvdeck.runtime.kv.prefix_node import RecomputeCost, default_recompute_cost
from kvdeck.runtime.kv.prefix_tree import PrefixTree
from kvdeck.runtime.kv.tiers import HOST_DEMOTED, HOST_SWAPPED, HostTier


class Figure:
    """A read-only attribute that is the KV state's, on whatever holds one in `holder`
    (the block manager, replay): one copy of the figure, read where it lives."""

    def __init__(self, holder: str):
        self.holder = holder

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return getattr(getattr(obj, self.holder), self.name)


LORA_MARK = "|lora:"
"""Between an engine's namespace and an adapter's name in the adapter's namespace."""


def adapter_of(namespace: str) -> str | None:
    """The LoRA adapter whose blocks a prefix-cache namespace holds (None: the base)."""
    return namespace.partition(LORA_MARK)[2] or None


REPLAY_NAMESPACE = "replay"
"""The one root replay files nodes under (a trace has their ids, not their tokens)."""


class KVState:
    """Pool, tables, host tier, reservations and prefix tree, changed only by `apply`."""

    def __init__(self, pool: BlockStates, *, host_blocks: int = 0,
                 groups: LayerGroups | None = None, clock: Callable[[], int] = lambda: 0,
                 record: bool = True, namespace: str = REPLAY_NAMESPACE,
                 cache_capacity: int = 0, eviction_policy: str = "lru",
                 recompute_cost: RecomputeCost = default_recompute_cost,
                 bytes_per_block: int = 1,
                 link_seconds: Callable[[int], float] = lambda nbytes: 0.0,
                 copies: list | None = None):
        """`clock`: the engine's step number (the tree's recency); `record`: keep every
        applied event in `events` until `take_events` (live: the step record carries them;
        replay: off). The rest configures the prefix tree (`PrefixTree`); `copies` is the queue
        its demotions' copies join."""
        self.pool = pool
        self.block_size = pool.block_size
        self.groups = groups
        self.clock = clock
        self.namespace = namespace
        self.bytes_per_block = bytes_per_block
        self.host = HostTier(host_blocks)
        self.tables: dict[str, list[int]] = {}
        self.window_tables: dict[str, list[list[int]]] = {}
        """Per request with layer groups: one page table per window sub-group (−1: freed)."""
        self.window_start: dict[str, int] = {}
        """Per window table: blocks before this index are freed."""
        self.page_groups = bytearray(pool.num_blocks)
        """Per page: 1 when a window table or a node's window pages hold it (the KV map
        draws the two groups apart); stale for free pages."""
        self.host_tables: dict[str, list[int]] = {}
        """Swapped-out requests' host blocks, in table order."""
        self.reserved: dict[str, int] = {}
        self.num_reserved = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.events: list[KVEvent] | None = [] if record else None
        self.released = False
        """Set when an applied event left a cached block to the cache alone (the manager
        then enforces a lowered capacity); the manager clears it."""
        self.tree = PrefixTree(pool, self.host, self.apply, cache_capacity, eviction_policy,
                               recompute_cost, bytes_per_block, link_seconds, copies)
        self._handlers: dict[type, Callable[[Any, Any], None]] = {
            Ref: self._ref, Unref: self._unref, Drop: self._hole, Cow: _nothing, Cache: self._cache,
            Evict: self._evict, Hit: self._hit, Reserve: self._reserve,
            Relayout: self._relayout, SwapOut: self._swap_out, SwapIn: self._swap_in,
            Unswap: self._unswap, Demote: self._demote, Promote: self._promote,
            HostResize: self._host_resize, WinRef: self._win_ref, WinUnref: self._win_unref,
            WinCache: self._win_cache, WinEvict: self._win_evict}

    def namespace_of(self, req) -> str:
        """The prefix-cache namespace of `req`'s blocks: the engine's (model, KV format),
        and its LoRA adapter's name when it runs one (vLLM keys blocks by adapter too)."""
        lora = req.sampling.lora
        return self.namespace if lora is None else f"{self.namespace}{LORA_MARK}{lora}"

    def apply(self, ev: KVEvent, extra: Any = None) -> None:
        """Change the state as `ev` says (and keep `ev` when recording). `extra`: what the
        event does not carry (module docstring). An event that does not fit the state
        raises KeyError, IndexError, ValueError or AssertionError."""
        events = self.events
        if events is not None:
            events.append(ev)
        self._handlers[type(ev)](ev, extra)

    def take_events(self) -> list[KVEvent]:
        """The events applied since the last call."""
        assert self.events is not None, "take_events on a state that does not record"
        events, self.events = self.events, []
        return events

    # -- block tables -----------------------------------------------------------------------

    def _ref(self, ev: Ref, _extra: Any) -> None:
        block, rid = ev.block, ev.request_id
        table = self.tables.get(rid)
        if table is None:
            table = self.tables[rid] = []
        if block < 0:  # a fork copying its parent's hole
            assert ev.index == len(table), f"{rid!r}: a hole replaces an entry"
            table.append(block)
            return
        self.pool.incref(block)
        self.tree.on_block_used(block)
        if self.groups:
            self.page_groups[block] = 0
        if ev.index == len(table):
            table.append(block)
            return
        # A replacement: copy-on-write, or a duplicate switched to the cached block.
        old, table[ev.index] = table[ev.index], block
        node = self.tree.node_of_block.get(block)
        if node is not None:
            self.tree.touch(node, self.clock())  # the cache handed out an existing block
        self._drop(old)

    def _unref(self, ev: Unref, _extra: Any) -> None:
        rid = ev.request_id
        table = self.tables.get(rid)
        if not table or table[-1] != ev.block or ev.index != len(table) - 1:
            raise ValueError(f"{rid!r} does not hold block {ev.block} last")
        table.pop()
        if not table:  # released: its window tables (all freed by now) go with it
            del self.tables[rid]
            wt = self.window_tables.pop(rid, None)
            if wt is not None:
                assert max(wt[0], default=-1) < 0, f"{rid!r} released with window pages"
                del self.window_start[rid]
        if ev.block >= 0:  # a hole holds nothing
            self._drop(ev.block)

    def _hole(self, ev: Drop, _extra: Any) -> None:
        rid, i = ev.request_id, ev.index
        table = self.tables.get(rid)
        if not table or i >= len(table) - 1 or table[i] != ev.block or ev.block < 0:
            raise ValueError(f"{rid!r} cannot evict block {ev.block} at {i} (not held there, "
                             "or its last)")
        table[i] = -1
        self._drop(ev.block)

    def _reserve(self, ev: Reserve, _extra: Any) -> None:
        self.num_reserved += ev.delta
        left = self.reserved.get(ev.request_id, 0) + ev.delta
        if left:
            self.reserved[ev.request_id] = left
        else:
            self.reserved.pop(ev.request_id, None)

    def _drop(self, block: int) -> None:
        """Drop one table reference to `block`, noting it in the tree if now cache-only."""
        pool = self.pool
        pool.decref(block)
        if pool.cached[block] and pool.refcount[block] == 1:
            self.tree.on_block_released(block, self.clock())
            self.released = True

    # -- the prefix tree --------------------------------------------------------------------

    def _cache(self, ev: Cache, extra: Any) -> None:
        tree = self.tree
        if extra is None:  # replay: by id under the one root
            parent = tree.nodes[ev.parent_id] if ev.parent_id else \
                tree.root(REPLAY_NAMESPACE)
            key: tuple[int, ...] = (ev.node_id,)
        else:
            parent, key = extra
        node = tree.add(ev.node_id, parent, key, ev.block, self.clock(), tree.num_lookups)
        assert node.depth_tokens == ev.end_token, f"node {ev.node_id} ends elsewhere"

    def _evict(self, ev: Evict, _extra: Any) -> None:
        self.tree.evict(self.tree.nodes[ev.node_id])

    def _hit(self, ev: Hit, extra: Any) -> None:
        """`extra`: the tokens the lookup asked about."""
        table = self.tables.get(ev.request_id, [])
        of_block = self.tree.node_of_block
        chain = [of_block[b] for b in table[:ev.num_tokens // self.block_size]]
        self.tree.record_lookup(chain, extra, self.clock())

    def _demote(self, ev: Demote, _extra: Any) -> None:
        node = self.tree.nodes[ev.node_id]
        assert node.block == ev.block, f"node {ev.node_id} is not in block {ev.block}"
        self.host.occupy(ev.host_block, HOST_DEMOTED)
        self.tree.demote_to(node, ev.host_block)

    def _promote(self, ev: Promote, _extra: Any) -> None:
        self.tree.promote(self.tree.nodes[ev.node_id], ev.block, hit=bool(ev.hit))

    def _win_cache(self, ev: WinCache, _extra: Any) -> None:
        for page in ev.pages:
            self.page_groups[page] = 1
        self.tree.attach_local(self.tree.nodes[ev.node_id], ev.pages, self.clock())

    def _win_evict(self, ev: WinEvict, _extra: Any) -> None:
        self.tree.drop_local(self.tree.nodes[ev.node_id])

    # -- the host tier ----------------------------------------------------------------------

    def _swap_out(self, ev: SwapOut, _extra: Any) -> None:
        hosts = [h for _, h in ev.pairs]
        for h in hosts:
            self.host.occupy(h, HOST_SWAPPED)
        self.host_tables[ev.request_id] = hosts
        self.num_swap_outs += 1

    def _swap_in(self, ev: SwapIn, _extra: Any) -> None:
        for h in self.host_tables.pop(ev.request_id):
            self.host.free(h)
        self.num_swap_ins += 1

    def _unswap(self, ev: Unswap, _extra: Any) -> None:
        for h in self.host_tables.pop(ev.request_id):
            self.host.free(h)

    def _host_resize(self, ev: HostResize, _extra: Any) -> None:
        self.host.resize(ev.num_blocks)

    # -- the pool's layout ------------------------------------------------------------------

    def _relayout(self, ev: Relayout, extra: Any) -> None:
        """`extra`: the namespace the re-encoded cached blocks now belong to (live)."""
        moves = {old: new for old, new in ev.moves}
        self.pool.relayout(ev.num_blocks, moves)
        for table in self.tables.values():
            for i, b in enumerate(table):
                if b in moves:
                    table[i] = moves[b]
        for tables in self.window_tables.values():
            for table in tables:
                table[:] = [moves.get(b, b) for b in table]
        groups = self.page_groups
        for old, new in moves.items():
            groups[new] = groups[old]
        groups[:] = (groups + bytearray(max(ev.num_blocks - len(groups), 0)))[:ev.num_blocks]
        self.tree.move_blocks(moves, ev.bytes_per_block)
        if extra is not None:
            self.tree.rename_namespace(self.namespace, extra)
            self.namespace = extra
        self.bytes_per_block = ev.bytes_per_block

    # -- sliding-window tables --------------------------------------------------------------

    def _win_ref(self, ev: WinRef, _extra: Any) -> None:
        rid, pool, tree = ev.request_id, self.pool, self.tree
        wt = self.window_tables.get(rid)
        if wt is None:  # a new table: the blocks before this one are behind the window
            wt = self.window_tables[rid] = [[-1] * ev.index for _ in ev.pages]
            self.window_start[rid] = ev.index
        for table, page in zip(wt, ev.pages, strict=True):
            pool.incref(page)
            tree.on_block_used(page)
            self.page_groups[page] = 1
            if ev.index == len(table):
                table.append(page)
            else:  # a replacement: copy-on-write, or a cached twin's pages
                old, table[ev.index] = table[ev.index], page
                if old >= 0:
                    self._drop(old)

    def _win_unref(self, ev: WinUnref, _extra: Any) -> None:
        """Block `index` slid behind the window (the first held one: freed in place) or
        was the table's last (truncated, or released last first)."""
        rid, i = ev.request_id, ev.index
        wt = self.window_tables.get(rid)
        if not wt or len(wt[0]) <= i or [t[i] for t in wt] != list(ev.pages):
            raise ValueError(f"{rid!r} does not hold window pages {ev.pages} at {i}")
        if i == self.window_start[rid]:
            for table in wt:
                table[i] = -1
            self.window_start[rid] = i + 1
        else:
            if i != len(wt[0]) - 1:
                raise ValueError(f"{rid!r} drops window block {i}, neither its first held "
                                 "nor its last")
            for table in wt:
                table.pop()
        for page in ev.pages:
            self._drop(page)

    # -- checkpoints and checks -------------------------------------------------------------

    def checkpoint_fields(self) -> dict[str, Any]:
        """The checkpoint's KV entries (`core/checkpoint.py`), the same live and replayed:
        tables, window tables, reservations, the tree's nodes and counters."""
        nodes, counters = export_tree(self.tree)
        return {"tables": {rid: list(t) for rid, t in self.tables.items()},
                "window_tables": {rid: [list(t) for t in wt]
                                  for rid, wt in self.window_tables.items()}
                if self.groups else None,
                "reserved": dict(self.reserved), "nodes": nodes, "tree": counters}

    def restore(self, tables: dict[str, list[int]],
                window_tables: dict[str, list[list[int]]] | None,
                reserved: dict[str, int], nodes: list[list], tree: dict[str, int],
                host_tables: dict[str, list[int]]) -> None:
        """Load a checkpoint's KV entries into this empty state (replay)."""
        pool = self.pool
        load_tree(self.tree, nodes, tree)
        for node in self.tree.nodes.values():
            for page in node.local:
                self.page_groups[page] = 1
        for rid, table in tables.items():
            self.tables[rid] = list(table)
            for block in filter(lambda b: b >= 0, table):
                pool.incref(block)
                self.tree.on_block_used(block)
        for rid, wt in (window_tables or {}).items():
            self.window_tables[rid] = [list(t) for t in wt]
            self.window_start[rid] = next((i for i, b in enumerate(wt[0]) if b >= 0),
                                          len(wt[0]))
            for table in wt:
                for page in table:
                    if page >= 0:
                        pool.incref(page)
                        self.tree.on_block_used(page)
                        self.page_groups[page] = 1
        self.reserved = dict(reserved)
        self.num_reserved = sum(reserved.values())
        for rid, hosts in host_tables.items():
            self.host_tables[rid] = list(hosts)
            for h in hosts:
                self.host.occupy(h, HOST_SWAPPED)

    def as_data(self) -> dict[str, Any]:
        """Every table as plain data, for comparing a live state with a replayed one."""
        return {"tables": {r: list(t) for r, t in self.tables.items()},
                "window_tables": {r: [list(t) for t in wt]
                                  for r, wt in self.window_tables.items()},
                "window_start": dict(self.window_start),
                "page_groups": bytes(g if s else 0 for s, g in
                                     zip(self.pool.states, self.page_groups, strict=True)),
                "host_tables": {r: list(t) for r, t in self.host_tables.items()},
                "reserved": dict(self.reserved), "num_reserved": self.num_reserved,
                "refcount": list(self.pool.refcount), "states": bytes(self.pool.states),
                "cached": bytes(self.pool.cached), "host_states": bytes(self.host.states),
                **dict(zip(("nodes", "tree"), export_tree(self.tree), strict=True))}

    def check_integrity(self) -> None:
        """Raise AssertionError unless refcounts equal table entries plus cache references,
        window tables are shaped as they should be, and the host tier agrees with the host
        tables."""
        pool = self.pool
        pool.check_integrity()
        self.tree.check_integrity()
        assert set(self.window_tables) <= set(self.tables)
        assert set(self.window_start) == set(self.window_tables)
        assert all(not t or t[-1] >= 0 for t in self.tables.values()), "a table ends in a hole"
        held = [chain.from_iterable(self.tables.values())]
        for rid, wt in self.window_tables.items():
            start = self.window_start[rid]
            for table in wt:
                assert len(table) == len(wt[0]) <= len(self.tables[rid]), \
                    f"{rid}: a window table's length"
                assert all(b < 0 for b in table[:start]), f"{rid}: a freed block is held"
                for b in table[start:]:
                    assert b >= 0, f"{rid}: a window block inside the window is missing"
                    assert self.page_groups[b], f"page {b} held as a window page"
                held.append(table[start:])
        blocks = np.fromiter(chain.from_iterable(held), dtype=np.int64)
        blocks = blocks[blocks >= 0]
        assert not blocks.size or blocks.max() < pool.num_blocks, \
            "a table names a block past the pool's end"
        rc, cached, _ = pool.arrays()
        expected = np.bincount(blocks, minlength=pool.num_blocks) + cached
        bad = np.flatnonzero(rc != expected)
        assert not bad.size, \
            f"block {bad[0]}: refcount {rc[bad[0]]} but {expected[bad[0]]} references"
        assert self.num_reserved == sum(self.reserved.values()) >= 0
        self.host.check_integrity()
        swapped = [h for hosts in self.host_tables.values() for h in hosts]
        assert len(swapped) == len(set(swapped)) == self.host.num_swapped, \
            "swapped host blocks disagree with the host tables"
        assert all(self.host.states[h] == HOST_SWAPPED for h in swapped)
        assert not set(self.host_tables) & set(self.tables), "a request on both tiers"


def _nothing(_ev: Cow, _extra: Any) -> None:
    """Copy-on-write: the Ref before it already moved the table entry."""

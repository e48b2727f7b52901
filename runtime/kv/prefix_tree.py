"""The shared-prefix index: a tree of full KV blocks keyed by their tokens.

Each node is one full block; its key is the block's tokens and its position in the tree is the
chain of blocks before it, so a node stands for an exact token prefix. Roots are namespaced
(model, adapter, KV format): KV is reusable only under the same namespace.

The tree holds one reference on each node's block (see `BlockPool`). A node whose block no
request uses is *evictable*; only leaves are evicted, so an evicted parent never strands a
child. Because requests always reference a whole chain from the root, a node no request uses
has no used descendants, and every evictable node becomes a leaf once its subtree is evicted.

Times (`last_access`) are engine step numbers: what LRU needs is an order, and step numbers
are in the iteration trace, so replay rebuilds exactly the tree the live engine had.

With a host tier (`kv/tiers.py`) an evicted device block may be *demoted*: its KV is copied
to a host block and the node stays in the tree, host-resident (`block` −1, `host_block`
set). A lookup matches host nodes like device ones; the admission that uses them promotes
them back first (a host hit). Host residency is closed downwards — a host node's children
are host nodes — so a matched chain is device nodes followed by host nodes, and a device
node counts as a leaf for eviction when it has no *device* children.

With `free_window_kv` (`kv/groups.py`) a node may also keep its block's sliding-window
pages (`local`), which a request released once it moved past them: a later hit can then
end at this node without recomputing the window before it. The cache's reference on them
is evictable on its own (the node stays, its full-attention page too), in the order they
were released; `evict_one` takes whichever is older, those pages or the LRU leaf.

Eviction policies (device victims; the host tier's own victims follow the same policy):

- `lru`: least recently used leaf first (a lazy heap keyed by last access).
- `value`: lowest retention value first, `V_h = p_h·(T_r − T_f) − T_m` per byte
  (docs/architecture.md, "Prefix retention"), with `p_h` estimated from the node's hits over
  the lookups since it was created and `T_r` the executor's estimate to recompute the block
  on top of its prefix. On the device `T_f = T_m = 0`; on the host tier `T_f` is the fetch
  back and `T_m` the one copy out, each `bytes / link bandwidth` (measured). A device block
  is demoted only when its host value is positive, and the device victim is the block whose
  eviction loses least: `V_device − max(V_host, 0)` when it would be demoted.

The node record is `kv/prefix_node.py`; the tree as checkpoint data (export, and the load
that replay rebuilds it with) is `kv/prefix_checkpoint.py`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from kvdeck.runtime.kv.block_pool import BlockStates
from kvdeck.runtime.kv.events import Cache, Demote, Evict, KVEvent, WinEvict
from kvdeck.runtime.kv.prefix_node import (
    PrefixNode,
    RecomputeCost,
    break_even_hit_rate,
    default_recompute_cost,
    pop_oldest,
    walk,
)
from kvdeck.runtime.kv.tiers import HOST_DEMOTED, HostTier

Copies = list
"""Pending block copies, each `(kind, direction, what, [[src, dst], ...])`, in the order
they must run (`BlockManager.copies`)."""


class PrefixTree:
    """Index of cached full blocks with hit accounting and eviction.

    The tree decides (what a lookup matches, which leaf to evict, whether to demote it) and
    changes itself only through `apply`, the owning `KVState.apply`, which calls back the
    mutators below (`add`, `evict`, `demote_to`, `promote`, `attach_local`, `drop_local`)
    for both the live manager and replay."""

    def __init__(self, pool: BlockStates, host: HostTier,
                 apply: Callable[[KVEvent, object], None], capacity: int = 0,
                 policy: str = "lru", recompute_cost: RecomputeCost = default_recompute_cost,
                 bytes_per_block: int = 1,
                 link_seconds: Callable[[int], float] = lambda nbytes: 0.0,
                 copies: Copies | None = None):
        """`host`: the tier demoted blocks go to (empty: evicted blocks are dropped);
        `apply`: how a decision takes effect; `link_seconds`: seconds to copy that many
        bytes one way over the host link (`T_f`, `T_m`); `copies`: the queue demotions'
        copies join (`BlockManager.copies`)."""
        self.pool = pool
        self.host = host
        self.apply = apply
        self.link_seconds = link_seconds
        self.copies: Copies = copies if copies is not None else []
        self.block_size = pool.block_size
        self.capacity = capacity
        self.policy = policy
        self.recompute_cost = recompute_cost
        self.bytes_per_block = bytes_per_block
        self.roots: dict[str, PrefixNode] = {}
        self.node_of_block: dict[int, PrefixNode] = {}
        self.nodes: dict[int, PrefixNode] = {}
        self._next_id = 1
        self._heap: list[tuple[int, int, PrefixNode]] = []
        self._leaves: set[PrefixNode] = set()
        """Evictable leaves: cache-only block, no children."""
        self.num_lookups = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.version = 0
        """Bumped on every change of structure or hits (see BlockStates.cache_version)."""
        self.demote = True
        """Whether evicted device blocks may be demoted (the `demote_prefixes` knob)."""
        self.host_nodes: dict[int, PrefixNode] = {}
        """Host block -> the demoted node in it."""
        self._host_leaves: set[PrefixNode] = set()
        self._host_heap: list[tuple[int, int, PrefixNode]] = []
        self.num_demotions = 0
        self.num_promotions = 0
        self.num_host_hit_tokens = 0
        self.local_of_page: dict[int, PrefixNode] = {}
        """Sliding-window page -> the node whose pages it is."""
        self._local_free: dict[PrefixNode, int] = {}
        """Nodes whose window pages only the cache holds, oldest release first -> step."""

    # -- lookup -----------------------------------------------------------------------------

    def root(self, namespace: str) -> PrefixNode:
        node = self.roots.get(namespace)
        if node is None:
            node = PrefixNode(0, None, (), -1, 0, 0, 0)
            self.roots[namespace] = node
        return node

    def match(self, namespace: str, keys: list[tuple[int, ...]], num_blocks: int | None = None,
              known: list[PrefixNode] | None = None) -> list[PrefixNode]:
        """The cached chain along the blocks whose tokens are `keys` (a request's `keys_of`,
        or `block_keys`; `walk`). No side effects: `record_lookup` counts a lookup acted on."""
        return walk(self.root(namespace), keys, num_blocks, known, self.nodes)

    def record_lookup(self, chain: list[PrefixNode], num_query_tokens: int, now: int) -> None:
        """Count a lookup of `num_query_tokens` tokens that reused `chain`: hit statistics,
        and the nodes are touched (and, being used now, no longer evictable)."""
        self.num_lookups += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += len(chain) * self.block_size
        for n in chain:
            n.hits += 1
            n.last_access = now
            self._leaves.discard(n)
        self.version += 1

    # -- insertion --------------------------------------------------------------------------

    def insert(self, namespace: str, parent: PrefixNode | None, key: tuple[int, ...],
               block: int) -> PrefixNode | None:
        """Cache `block` (holding `key`) under `parent` (None: the root).

        Returns the node for that prefix: an existing one when the content is already cached
        (the caller may then drop its duplicate block), or None when the cache is at capacity
        and nothing can be evicted.
        """
        parent = parent or self.root(namespace)
        existing = parent.children.get(key)
        if existing is not None:
            return existing  # the caller's Ref to its block touches it
        if self.capacity and len(self.node_of_block) >= self.capacity:
            if self.evict_one(node_only=True) is None:
                return None
        node_id = self._next_id
        self.apply(Cache(node_id, parent.node_id, block, parent.depth_tokens + self.block_size),
                   (parent, key))
        return self.nodes[node_id]

    def add(self, node_id: int, parent: PrefixNode, key: tuple[int, ...], block: int,
            now: int, created_lookup: int) -> PrefixNode:
        """Make `block` node `node_id` under `parent` (applying a `Cache` event)."""
        node = PrefixNode(node_id, parent, key, block, parent.depth_tokens + self.block_size,
                          created_lookup, now)
        self._next_id = max(self._next_id, node_id + 1)
        parent.children[key] = node
        self._leaves.discard(parent)
        self.node_of_block[block] = node
        self.nodes[node_id] = node
        self.pool.mark_cached(block)
        self._note_if_evictable(node)
        self.version += 1
        return node

    def restore(self, node_id: int, parent_id: int, block: int, now: int,
                created_lookup: int = 0) -> PrefixNode:
        """Re-create a node with a known id under a known parent (replay, which has the
        trace's ids but not the tokens: the node is keyed by its id)."""
        parent = self.nodes[parent_id] if parent_id else self.root("replay")
        return self.add(node_id, parent, (node_id,), block, now, created_lookup)

    def touch(self, node: PrefixNode, now: int) -> None:
        """A request took `node`'s block from the cache (a duplicate switched to it)."""
        node.last_access = now
        self.version += 1

    def host_nodes_restore(self, node_id: int, parent_id: int, host_block: int, now: int,
                           created_lookup: int) -> PrefixNode:
        """Re-create a demoted node in host block `host_block` (checkpoint loading)."""
        self.host.occupy(host_block, HOST_DEMOTED)
        parent = self.nodes[parent_id] if parent_id else self.root("replay")
        node = PrefixNode(node_id, parent, (node_id,), -1,
                          parent.depth_tokens + self.block_size, created_lookup, now,
                          host_block=host_block)
        parent.children[node.key] = node
        self.nodes[node_id] = node
        self.host_nodes[host_block] = node
        self._next_id = max(self._next_id, node_id + 1)
        self._note_host_leaf(node)
        if not parent.on_host:
            self._leaves.discard(parent)
            self._note_if_evictable(parent)
        else:
            self._host_leaves.discard(parent)
        self.version += 1
        return node

    def move_blocks(self, moves: dict[int, int], bytes_per_block: int) -> None:
        """The pool moved cached blocks (`old -> new`) and changed its block size in bytes
        (the host tier is empty then: `HostSwaps.drop_host_tier`)."""
        for node in self.node_of_block.values():
            node.block = moves.get(node.block, node.block)
            if node.local:
                node.local = tuple(moves.get(p, p) for p in node.local)
        self.node_of_block = {n.block: n for n in self.node_of_block.values()}
        self.local_of_page = {p: n for n in self.node_of_block.values() for p in n.local}
        self.bytes_per_block = bytes_per_block
        self.version += 1

    def rename_namespace(self, old: str, new: str) -> None:
        """Cached blocks now hold KV of another kind (converted): file them under `new`, and
        the adapters' namespaces under `old` (`old|lora:name`) likewise."""
        for name in [n for n in self.roots if n == old or n.startswith(old + "|")]:
            root = self.roots.pop(name)
            moved = new + name[len(old):]
            stale = self.roots.get(moved)
            assert stale is None or not stale.children, f"namespace {moved} already has blocks"
            self.roots[moved] = root

    # -- eviction ---------------------------------------------------------------------------

    def _note_if_evictable(self, node: PrefixNode) -> None:
        if node.block < 0 or self.pool.refcount[node.block] != 1:
            return  # the root, a host node, or in use
        if node.children and (not self.host_nodes  # then every child is on the device
                              or any(c.block >= 0 for c in node.children.values())):
            return
        if node not in self._leaves:
            self._leaves.add(node)
            heapq.heappush(self._heap, (node.last_access, node.node_id, node))

    def on_block_released(self, block: int, now: int) -> None:
        """A request dropped its reference to `block`; note it if it became evictable."""
        node = self.node_of_block.get(block)
        if node is not None:
            node.last_access = now
            self._leaves.discard(node)
            self._note_if_evictable(node)
        elif self.local_of_page:
            node = self.local_of_page.get(block)
            if node is not None:
                self._note_local(node, now)

    def on_block_used(self, block: int) -> None:
        """A request took a reference to a cached block: it is no longer evictable."""
        node = self.node_of_block.get(block)
        if node is not None:
            self._leaves.discard(node)
        elif self.local_of_page:
            node = self.local_of_page.get(block)
            if node is not None:
                self._local_free.pop(node, None)

    # -- sliding-window pages (free_window_kv) ----------------------------------------------

    def attach_local(self, node: PrefixNode, pages: list[int], now: int) -> None:
        """Keep `pages`, the sliding-window pages of `node`'s block, in the cache."""
        assert not node.local and node.block >= 0, f"node {node.node_id} cannot take pages"
        for page in pages:
            self.pool.mark_cached(page)
            self.local_of_page[page] = node
        node.local = tuple(pages)
        self._note_local(node, now)
        self.version += 1

    def _note_local(self, node: PrefixNode, now: int) -> None:
        rc = self.pool.refcount
        if all(rc[p] == 1 for p in node.local):
            self._local_free.pop(node, None)
            self._local_free[node] = now  # to the end: released last

    def drop_local(self, node: PrefixNode) -> None:
        """Free `node`'s window pages, which only the cache holds (the node stays)."""
        self._free_local(node)
        self.version += 1

    def _free_local(self, node: PrefixNode) -> None:
        for page in node.local:
            del self.local_of_page[page]
            freed = self.pool.unmark_cached(page)
            assert freed, f"window page {page} of node {node.node_id} is still in use"
        node.local = ()
        self._local_free.pop(node, None)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request uses; all of them can be evicted, leaves first."""
        return self.pool.num_cached_only

    def hit_chance(self, node: PrefixNode) -> float:
        """`p_h`: (hits + 1) / (lookups since `node` was cached + 2)."""
        return (node.hits + 1) / (self.num_lookups - node.created_lookup + 2)

    def retention_value(self, node: PrefixNode, tier: str = "device") -> float:
        """`V_h = p_h·(T_r − T_f) − T_m` per byte of keeping `node` on `tier`: on the device
        `T_f = T_m = 0`; on the host both are one copy over the link."""
        p_hit = self.hit_chance(node)
        t_recompute = self.recompute_cost(node.depth_tokens - self.block_size, self.block_size)
        if tier == "device":
            return p_hit * t_recompute / self.bytes_per_block
        t_link = self.link_seconds(self.bytes_per_block)
        return (p_hit * (t_recompute - t_link) - t_link) / self.bytes_per_block

    def break_even(self, node: PrefixNode) -> float:
        """The hit probability above which keeping `node` on the host tier saves time
        (`T_f = T_m` = one copy over the link)."""
        t_link = self.link_seconds(self.bytes_per_block)
        return break_even_hit_rate(
            self.recompute_cost(node.depth_tokens - self.block_size, self.block_size),
            t_link, t_link)

    def _can_demote(self) -> bool:
        return self.demote and self.host.num_blocks > 0

    def _eviction_loss(self, node: PrefixNode) -> float:
        """What evicting device `node` loses per byte: all its value when dropped, the
        difference when demoted (a host copy keeps `V_host`)."""
        value = self.retention_value(node)
        if self._can_demote():
            value -= max(self.retention_value(node, "host"), 0.0)
        return value

    def _pick_victim(self) -> PrefixNode | None:
        if not self._leaves:
            return None
        if self.policy == "value":
            return min(self._leaves, key=lambda n: (self._eviction_loss(n), n.node_id))
        return pop_oldest(self._heap, self._leaves)

    def evict_one(self, node_only: bool = False) -> int | None:
        """Evict one evictable device leaf — demoted to the host tier when that is worth it
        and possible, dropped otherwise — or, when they were released before that leaf was
        last used, one node's sliding-window pages (not with `node_only`: the capacity
        counts nodes); returns a freed device block (page), or None if none is evictable."""
        node = self._pick_victim()
        if not node_only and self._local_free:
            oldest = next(iter(self._local_free))
            if node is None or self._local_free[oldest] <= node.last_access:
                if node is not None and self.policy != "value":  # it stays a candidate
                    heapq.heappush(self._heap, (node.last_access, node.node_id, node))
                page = oldest.local[0]
                self.apply(WinEvict(oldest.node_id), None)
                return page
        if node is None:
            return None
        block = node.block
        if self._can_demote() and (self.policy != "value"
                                   or self.retention_value(node, "host") > 0) \
                and self._host_room(node):
            self._demote(node)
        else:
            self._drop_host_subtree(node)
            self.apply(Evict(node.node_id, block), None)
        return block

    def _host_room(self, node: PrefixNode) -> bool:
        """Make a host block free for demoting `node`, dropping the host tier's victim if
        it is full (under `value`, only one worth less than `node` on the host)."""
        host = self.host
        if host.num_free:
            return True
        victim = self._pick_host_victim()
        if victim is None:
            return False
        if self.policy == "value" and \
                self.retention_value(victim, "host") >= self.retention_value(node, "host"):
            return False
        self.apply(Evict(victim.node_id, -1), None)
        return True

    def make_host_room(self, num_blocks: int) -> bool:
        """Drop demoted blocks (the host tier's victims first) until `num_blocks` host blocks
        are free (a swap-out needs them); False when not enough can be freed."""
        host = self.host
        while host.num_free < num_blocks:
            victim = self._pick_host_victim()
            if victim is None:
                return False
            self.apply(Evict(victim.node_id, -1), None)
        return True

    def _pick_host_victim(self) -> PrefixNode | None:
        if not self._host_leaves:
            return None
        if self.policy == "value":
            return min(self._host_leaves,
                       key=lambda n: (self.retention_value(n, "host"), n.node_id))
        return pop_oldest(self._host_heap, self._host_leaves)

    def _note_host_leaf(self, node: PrefixNode) -> None:
        if node.on_host and not node.children and node not in self._host_leaves:
            self._host_leaves.add(node)
            heapq.heappush(self._host_heap, (node.last_access, node.node_id, node))

    def _demote(self, node: PrefixNode) -> None:
        """Move device leaf `node` to a free host block: its device block is freed now, the
        copy out runs before the next forward pass (`copies`)."""
        block = node.block
        (host_block,) = self.host.pick(1)
        self.apply(Demote(node.node_id, block, host_block), None)
        self.copies.append(("demote", "d2h", f"node {node.node_id}", [[block, host_block]]))

    def demote_to(self, node: PrefixNode, host_block: int) -> None:
        """Account `node` as living in `host_block` (live, or replaying a Demote)."""
        assert not node.local, "window pages have no host tier (free_window_kv refuses one)"
        self._leaves.discard(node)
        del self.node_of_block[node.block]
        freed = self.pool.unmark_cached(node.block)
        assert freed, "a demoted block must have no other reference"
        node.block, node.host_block = -1, host_block
        self.host_nodes[host_block] = node
        self._note_host_leaf(node)
        parent = node.parent
        self._host_leaves.discard(parent)
        self._note_if_evictable(parent)
        self.num_demotions += 1
        self.version += 1

    def pin_host(self, nodes: list[PrefixNode]) -> None:
        """Host nodes about to be promoted: not host victims meanwhile."""
        for n in nodes:
            self._host_leaves.discard(n)

    def promote(self, node: PrefixNode, block: int, hit: bool = True) -> None:
        """Bring demoted `node` back to device block `block` (its parent is on the device),
        which the caller holds one reference to; the host block is freed. `hit`: a lookup
        found it (a host hit: the caller queues the copy back); otherwise a request computed
        the same content into `block` itself and nothing is copied."""
        host_block = node.host_block
        self._host_leaves.discard(node)
        del self.host_nodes[host_block]
        self.host.free(host_block)
        node.block, node.host_block = block, -1
        self.node_of_block[block] = node
        self.pool.mark_cached(block)
        self._note_if_evictable(node)
        self._leaves.discard(node.parent)
        if hit:
            self.num_promotions += 1
            self.num_host_hit_tokens += self.block_size
        self.version += 1

    def _drop_host_subtree(self, node: PrefixNode) -> None:
        """Drop every host-resident descendant of `node`, deepest first (iteratively:
        demoted chains can be thousands of blocks deep)."""
        order: list[PrefixNode] = []
        stack = [c for c in node.children.values() if c.on_host]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())  # a host node's children are host nodes
        for n in reversed(order):  # children before their parents
            self.apply(Evict(n.node_id, -1), None)

    def evict(self, node: PrefixNode) -> None:
        """Remove leaf `node` (applying an `Evict` event) and free its block: a device
        block only the cache holds, or a host block (a demoted node)."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key]
        del self.nodes[node.node_id]
        if node.on_host:
            self._host_leaves.discard(node)
            del self.host_nodes[node.host_block]
            self.host.free(node.host_block)
        else:
            self._leaves.discard(node)
            del self.node_of_block[node.block]
            freed = self.pool.unmark_cached(node.block)
            assert freed, "an evictable block must have no other reference"
            if node.local:  # its window pages go with it
                self._free_local(node)
        self.num_evictions += 1
        self.version += 1
        if parent.on_host:
            self._note_host_leaf(parent)
        else:
            self._note_if_evictable(parent)

    def clear(self) -> int:
        """Drop everything evictable, host tier included (no demotion); returns how many
        device blocks were freed."""
        demote, self.demote = self.demote, False
        n = 0
        try:
            while self.evict_one() is not None:
                n += 1
            self.drop_host()
        finally:
            self.demote = demote
        return n

    def forget_blocks(self, blocks: tuple[int, ...]) -> int:
        """The executor no longer has the KV of `blocks` (llama.cpp recycled the slot that
        held them): evict their cache nodes that only the cache holds, deepest first, so no
        admission counts a hit the executor would have to recompute outside the token
        budget. Returns how many were evicted."""
        nodes = [n for b in blocks if (n := self.node_of_block.get(b)) is not None]
        evicted = 0
        for node in sorted(nodes, key=lambda n: -n.depth_tokens):
            if not node.children and self.pool.refcount[node.block] == 1:
                self.apply(Evict(node.node_id, node.block), None)
                evicted += 1
        return evicted

    def drop_host(self) -> int:
        """Drop every demoted block; returns how many."""
        n = 0
        while (victim := self._pick_host_victim()) is not None:
            self.apply(Evict(victim.node_id, -1), None)
            n += 1
        return n

    # -- views ------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.node_of_block)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def check_integrity(self) -> None:
        """Raise AssertionError unless tree, block map, pool flags and leaf set agree."""
        # Runs after every step of an integrity-checked run, over every node: names bound once.
        seen: set[int] = set()
        on_host: set[int] = set()
        refcount, cached, bs = self.pool.refcount, self.pool.cached, self.block_size
        node_of_block, nodes, leaves = self.node_of_block, self.nodes, self._leaves
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            parent, children = n.parent, n.children
            assert parent is not None and parent.children.get(n.key) is n
            if n.host_block >= 0:
                assert n.block == -1 and self.host_nodes.get(n.host_block) is n, \
                    f"host node {n.node_id} not indexed"
                assert self.host.states[n.host_block] == HOST_DEMOTED
                assert all(c.on_host for c in children.values()), \
                    f"host node {n.node_id} has a device child"
                assert (n in self._host_leaves) == (not children)
                assert nodes.get(n.node_id) is n
                on_host.add(n.host_block)
                stack.extend(children.values())
                continue
            block = n.block
            assert block not in seen, f"block {block} appears twice in the tree"
            seen.add(block)
            assert node_of_block.get(block) is n, f"node {n.node_id} not indexed"
            assert nodes.get(n.node_id) is n, f"node {n.node_id} not indexed by id"
            assert cached[block], f"block {block} in tree but not flagged cached"
            rc = refcount[block]
            assert rc >= 1
            assert n.depth_tokens == parent.depth_tokens + bs
            if rc > 1 and parent.parent is not None:
                # A used node's ancestors are used too (requests hold whole chains).
                assert refcount[parent.block] > 1, \
                    f"node {n.node_id} is used but its parent is cache-only"
            is_leaf = rc == 1 and not any(c.block >= 0 for c in children.values())
            assert (n in leaves) == is_leaf, f"node {n.node_id} leaf-set mismatch"
            stack.extend(children.values())
        assert seen == set(self.node_of_block), "block index holds nodes not in the tree"
        assert on_host == set(self.host_nodes), "host index holds nodes not in the tree"
        assert len(self.nodes) == len(seen) + len(on_host), "id index holds stray nodes"
        if self.host is not None:
            assert self.host.num_demoted == len(on_host), "demoted count disagrees"
        flagged = set(np.flatnonzero(np.frombuffer(bytes(self.pool.cached), np.uint8)).tolist())
        assert flagged == seen | set(self.local_of_page), \
            "pool cache flags disagree with the tree"
        for page, n in self.local_of_page.items():
            assert page in n.local and n.block >= 0, f"window page {page} misfiled"
            assert page not in seen, f"page {page} is both a window and a full page"
        for n in self.nodes.values():
            free = bool(n.local) and all(self.pool.refcount[p] == 1 for p in n.local)
            assert (n in self._local_free) == free, f"node {n.node_id} window-free mismatch"
        if self.capacity and len(seen) > self.capacity:
            # Only blocks that running requests still use may exceed a lowered capacity.
            assert not self._leaves, "over capacity while blocks are evictable"

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

Eviction policies:

- `lru`: least recently used leaf first (a lazy heap keyed by last access).
- `value`: lowest retention value first, `V_h = p_h·(T_r − T_f) − T_m` per byte
  (docs/architecture.md, "Prefix retention"), with `p_h` estimated from the node's hits over
  the lookups since it was created, `T_r` the executor's estimate to recompute the block on
  top of its prefix, and `T_f = T_m = 0` on the device tier.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from runtime.kv.block_pool import BlockStates
from runtime.records import Evict

RecomputeCost = Callable[[int, int], float]
"""(tokens before the block, tokens in the block) -> seconds to recompute it."""


def default_recompute_cost(num_prior: int, num_new: int) -> float:
    pairs = num_new * num_prior + num_new * (num_new + 1) // 2
    return 1e-4 * num_new + 1e-9 * pairs


@dataclass(eq=False)
class PrefixNode:
    """One cached full block."""

    node_id: int
    parent: PrefixNode | None
    key: tuple[int, ...]
    """The block's tokens (replay, which has no tokens, keys nodes by their id instead)."""
    block: int
    depth_tokens: int
    """Tokens from the root through the end of this block."""
    created_lookup: int
    last_access: int
    """Engine step of the last use."""
    hits: int = 0
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeSummary:
    """What the snapshot shows of the tree: one segment, a chain of blocks in which every
    block but the last has exactly one child and all have the same users (radix-style)."""

    node_id: int
    """Id of the segment's first node."""
    parent_id: int
    """Id of the segment's parent's *last* node's segment (0: the root)."""
    block: int
    start_token: int
    end_token: int
    num_blocks: int
    num_users: int
    """Block-table references (requests using the blocks), not counting the cache's own."""
    hits: int
    last_access: int
    """Engine step of the segment's most recent use."""
    evictable: bool


class PrefixTree:
    """Index of cached full blocks with hit accounting and eviction."""

    def __init__(self, pool: BlockStates, capacity: int = 0, policy: str = "lru",
                 recompute_cost: RecomputeCost = default_recompute_cost,
                 bytes_per_block: int = 1, events: list | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.capacity = capacity
        self.policy = policy
        self.recompute_cost = recompute_cost
        self.bytes_per_block = bytes_per_block
        self.roots: dict[str, PrefixNode] = {}
        self.node_of_block: dict[int, PrefixNode] = {}
        self.nodes: dict[int, PrefixNode] = {}
        self._ids = itertools.count(1)
        self._heap: list[tuple[int, int, PrefixNode]] = []
        self._leaves: set[PrefixNode] = set()
        """Evictable leaves: cache-only block, no children."""
        self.num_lookups = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.version = 0
        """Bumped on every change of structure or hits (see BlockStates.cache_version)."""
        self.events = events if events is not None else []
        """Eviction events (`records.Evict`), appended as they happen."""

    # -- lookup -----------------------------------------------------------------------------

    def root(self, namespace: str) -> PrefixNode:
        node = self.roots.get(namespace)
        if node is None:
            node = PrefixNode(0, None, (), -1, 0, 0, 0)
            self.roots[namespace] = node
        return node

    def match(self, namespace: str, tokens: list[int]) -> list[PrefixNode]:
        """The chain of cached nodes covering the longest full-block prefix of `tokens`
        (no side effects; `record_lookup` counts a lookup that is acted on)."""
        p = self.block_size
        node = self.root(namespace)
        chain: list[PrefixNode] = []
        for start in range(0, len(tokens) - p + 1, p):
            child = node.children.get(tuple(tokens[start:start + p]))
            if child is None:
                break
            chain.append(child)
            node = child
        return chain

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
               block: int, now: int) -> PrefixNode | None:
        """Cache `block` (holding `key`) under `parent` (None: the root).

        Returns the node for that prefix: an existing one when the content is already cached
        (the caller may then drop its duplicate block), or None when the cache is at capacity
        and nothing can be evicted.
        """
        parent = parent or self.root(namespace)
        existing = parent.children.get(key)
        if existing is not None:
            existing.last_access = now
            self.version += 1
            return existing
        if self.capacity and len(self.node_of_block) >= self.capacity:
            if self.evict_one() is None:
                return None
        return self._add(next(self._ids), parent, key, block, now, self.num_lookups)

    def _add(self, node_id: int, parent: PrefixNode, key: tuple[int, ...], block: int,
             now: int, created_lookup: int) -> PrefixNode:
        node = PrefixNode(node_id, parent, key, block, parent.depth_tokens + self.block_size,
                          created_lookup, now)
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
        node = self._add(node_id, parent, (node_id,), block, now, created_lookup)
        self._ids = itertools.count(max(node_id + 1, next(self._ids)))
        return node

    def export(self) -> tuple[list[list[int]], dict[str, int]]:
        """The tree as checkpoint data: [node id, parent id, block, end token, hits, last
        access, created lookup] per node (parents first), and the lookup counters."""
        nodes = [[n.node_id, n.parent.node_id if n.parent and n.parent.block >= 0 else 0,
                  n.block, n.depth_tokens, n.hits, n.last_access, n.created_lookup]
                 for n in sorted(self.nodes.values(), key=lambda n: n.node_id)]
        counters = {"lookups": self.num_lookups, "query_tokens": self.num_query_tokens,
                    "hit_tokens": self.num_hit_tokens, "evictions": self.num_evictions}
        return nodes, counters

    def load(self, nodes: list[list[int]], counters: dict[str, int]) -> None:
        """Rebuild from `export()` data into an empty tree (replay)."""
        for node_id, parent_id, block, _end, hits, last_access, created in nodes:
            self.restore(node_id, parent_id, block, last_access, created).hits = hits
        self.num_lookups = counters["lookups"]
        self.num_query_tokens = counters["query_tokens"]
        self.num_hit_tokens = counters["hit_tokens"]
        self.num_evictions = counters["evictions"]

    def move_blocks(self, moves: dict[int, int], bytes_per_block: int) -> None:
        """The pool moved cached blocks (`old -> new`) and changed its block size in bytes."""
        for node in self.node_of_block.values():
            node.block = moves.get(node.block, node.block)
        self.node_of_block = {n.block: n for n in self.node_of_block.values()}
        self.bytes_per_block = bytes_per_block
        self.version += 1

    def rename_namespace(self, old: str, new: str) -> None:
        """Cached blocks now hold KV of another kind (converted): file them under `new`."""
        root = self.roots.pop(old, None)
        if root is not None:
            stale = self.roots.get(new)
            assert stale is None or not stale.children, f"namespace {new} already has blocks"
            self.roots[new] = root

    # -- eviction ---------------------------------------------------------------------------

    def _note_if_evictable(self, node: PrefixNode) -> None:
        if node.children or node.block < 0 or self.pool.refcount[node.block] != 1:
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

    def on_block_used(self, block: int) -> None:
        """A request took a reference to a cached block: it is no longer evictable."""
        node = self.node_of_block.get(block)
        if node is not None:
            self._leaves.discard(node)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request uses; all of them can be evicted, leaves first."""
        return self.pool.num_cached_only

    def retention_value(self, node: PrefixNode) -> float:
        """`V_h` per byte for a device-resident block: hit probability × recompute time."""
        lookups = self.num_lookups - node.created_lookup
        p_hit = (node.hits + 1) / (lookups + 2)
        t_recompute = self.recompute_cost(node.depth_tokens - self.block_size, self.block_size)
        return p_hit * t_recompute / self.bytes_per_block

    def _pick_victim(self) -> PrefixNode | None:
        if not self._leaves:
            return None
        if self.policy == "value":
            return min(self._leaves, key=lambda n: (self.retention_value(n), n.node_id))
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node in self._leaves and stamp == node.last_access:
                return node
        # Every leaf's heap entry was stale (touched after being pushed): rebuild.
        self._heap = [(n.last_access, n.node_id, n) for n in self._leaves]
        heapq.heapify(self._heap)
        return self._pick_victim()

    def evict_one(self) -> int | None:
        """Evict one evictable leaf; returns the freed block, or None if none is evictable."""
        node = self._pick_victim()
        if node is None:
            return None
        self.evict(node)
        return node.block

    def evict(self, node: PrefixNode) -> None:
        """Remove leaf `node` (its block only the cache holds) and free its block."""
        self._leaves.discard(node)
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key]
        del self.node_of_block[node.block]
        del self.nodes[node.node_id]
        freed = self.pool.unmark_cached(node.block)
        assert freed, "an evictable block must have no other reference"
        self.num_evictions += 1
        self.version += 1
        self.events.append(Evict(node.node_id, node.block))
        self._note_if_evictable(parent)

    def clear(self) -> int:
        """Evict everything evictable; returns how many blocks were freed."""
        n = 0
        while self.evict_one() is not None:
            n += 1
        return n

    # -- views ------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.node_of_block)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def summary(self, limit: int = 256, max_nodes: int = 2048) -> list[NodeSummary]:
        """Up to `limit` segments, depth first, the most used and most hit siblings first,
        visiting at most `max_nodes` nodes: the shared parts of a large tree come first, and
        a snapshot stays cheap when hundreds of requests hold long private chains."""
        out: list[NodeSummary] = []
        rc = self.pool.refcount
        p = self.block_size
        budget = max_nodes

        def order(nodes: Iterable[PrefixNode]) -> list[PrefixNode]:
            return sorted(nodes, key=lambda n: (-rc[n.block], -n.hits, n.node_id))

        stack = [(c, 0) for r in self.roots.values() for c in reversed(order(r.children.values()))]
        while stack and len(out) < limit and budget > 0:
            first, parent_id = stack.pop()
            count = rc[first.block]
            last, n, access = first, 1, first.last_access
            children = last.children
            while len(children) == 1 and n < budget:
                (child,) = children.values()
                if rc[child.block] != count:
                    break
                last, n, children = child, n + 1, child.children
                if child.last_access > access:
                    access = child.last_access
            budget -= n
            # A lookup touches a whole chain from the root, so hits never grow along a
            # chain: the segment's first node has the most.
            out.append(NodeSummary(first.node_id, parent_id, first.block,
                                   first.depth_tokens - p, last.depth_tokens, n,
                                   count - 1, first.hits, access, count == 1))
            stack.extend((c, first.node_id) for c in reversed(order(children.values())))
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless tree, block map, pool flags and leaf set agree."""
        seen: set[int] = set()
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            assert n.block not in seen, f"block {n.block} appears twice in the tree"
            seen.add(n.block)
            assert self.node_of_block.get(n.block) is n, f"node {n.node_id} not indexed"
            assert self.nodes.get(n.node_id) is n, f"node {n.node_id} not indexed by id"
            assert self.pool.cached[n.block], f"block {n.block} in tree but not flagged cached"
            assert self.pool.refcount[n.block] >= 1
            assert n.parent is not None and n.parent.children.get(n.key) is n
            assert n.depth_tokens == n.parent.depth_tokens + self.block_size
            rc = self.pool.refcount[n.block]
            if rc > 1 and n.parent.block >= 0:
                # A used node's ancestors are used too (requests hold whole chains).
                assert self.pool.refcount[n.parent.block] > 1, \
                    f"node {n.node_id} is used but its parent is cache-only"
            is_leaf = rc == 1 and not n.children
            assert (n in self._leaves) == is_leaf, f"node {n.node_id} leaf-set mismatch"
            stack.extend(n.children.values())
        assert seen == set(self.node_of_block), "block index holds nodes not in the tree"
        assert len(self.nodes) == len(seen), "id index holds nodes not in the tree"
        flagged = {b for b in range(self.pool.num_blocks) if self.pool.cached[b]}
        assert flagged == seen, "pool cache flags disagree with the tree"
        if self.capacity and len(seen) > self.capacity:
            # Only blocks that running requests still use may exceed a lowered capacity.
            assert not self._leaves, "over capacity while blocks are evictable"

"""What the console shows of the prefix tree: its chains as radix-style segments, the shared
parts first (`PrefixTree` keeps blocks; this reads it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvdeck.runtime.kv.prefix_node import PrefixNode
from kvdeck.runtime.kv.prefix_tree import PrefixTree


class NodeSummary(NamedTuple):
    """What the snapshot shows of the tree: one segment, a chain of blocks in which every
    block but the last has exactly one child and all have the same users (radix-style).
    A tuple: a snapshot builds hundreds, up to ten times a second."""

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
    on_host: bool = False
    """The segment is demoted to the host tier."""
    p_hit: float | None = None
    """Estimated chance a lookup hits the segment's first block: `(hits + 1) / (lookups since
    it was made + 2)` (the prefix tree's own estimate, `PrefixTree.hit_chance`)."""
    value_ms: float | None = None
    """`V_h` of that block on the device: `p_hit × T_r`, the recompute time a lookup is
    expected to save by its being kept (ms). None where the recompute cost is not the
    engine's (a replay)."""
    break_even: float | None = None
    """The hit probability above which keeping it on the host tier saves time
    (`PrefixTree.break_even`); None as `value_ms`."""


VALUED = 32
"""Shared or unused segments a snapshot prices the retention value of (the rest, and a
running request's own tail, show none)."""


def summarize_tree(tree: PrefixTree, limit: int = 256, max_nodes: int = 2048,
                   values: bool = True) -> list[NodeSummary]:
    """Up to `limit` segments, depth first, the most used and most hit siblings first,
    visiting at most `max_nodes` nodes: the shared parts of a large tree come first, and
    a snapshot stays cheap when hundreds of requests hold long private chains. `values`:
    the retention value and break-even of the first `VALUED` segments that are shared or
    cached with no user — the shared ones come first; each costs a step-time estimate (the
    tree's recompute cost must be the engine's: a replay's is not)."""
    out: list[NodeSummary] = []
    rc = tree.pool.refcount
    p = tree.block_size
    budget = max_nodes
    valued = 0

    def order(nodes: Iterable[PrefixNode]) -> list[PrefixNode]:
        return sorted(nodes, key=lambda n: (-users(n), -n.hits, n.node_id))

    def users(n: PrefixNode) -> int:
        return rc[n.block] if n.block >= 0 else 0  # a host node: no user, no cache ref

    stack = [(c, 0) for r in tree.roots.values() for c in reversed(order(r.children.values()))]
    while stack and len(out) < limit and budget > 0:
        first, parent_id = stack.pop()
        count = users(first)
        last, n, access = first, 1, first.last_access
        children = last.children
        while len(children) == 1 and n < budget:
            (child,) = children.values()
            if users(child) != count:
                break
            last, n, children = child, n + 1, child.children
            if child.last_access > access:
                access = child.last_access
        budget -= n
        # A lookup touches a whole chain from the root, so hits never grow along a
        # chain: the segment's first node has the most.
        # Priced where eviction or retention is a question: blocks shared by several
        # requests, or cached with none (a running request's own tail cannot be evicted).
        priced = values and valued < VALUED and (count > 2 or count <= 1)
        value = _value(tree, first) if priced else (None, None, None)
        valued += priced
        out.append(NodeSummary(first.node_id, parent_id, first.block,
                               first.depth_tokens - p, last.depth_tokens, n,
                               max(count - 1, 0), first.hits, access, count <= 1,
                               first.on_host, *value))
        stack.extend((c, first.node_id) for c in reversed(order(children.values())))
    return out


def _value(tree: PrefixTree, node: PrefixNode) -> tuple[float, float, float]:
    """(p_hit, V_h in ms, host break-even) of `node`, as the tree's value policy weighs it."""
    return tree.hit_chance(node), tree.retention_value(node) * tree.bytes_per_block * 1e3, \
        tree.break_even(node)

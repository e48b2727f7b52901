"""What the console shows of the prefix tree: its chains as radix-style segments, the shared
parts first (`PrefixTree` keeps blocks; this reads it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdeck.runtime.kv.prefix_node import PrefixNode
from kvdeck.runtime.kv.prefix_tree import PrefixTree


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
    on_host: bool = False
    """The segment is demoted to the host tier."""


def summarize_tree(tree: PrefixTree, limit: int = 256, max_nodes: int = 2048
                   ) -> list[NodeSummary]:
    """Up to `limit` segments, depth first, the most used and most hit siblings first,
    visiting at most `max_nodes` nodes: the shared parts of a large tree come first, and
    a snapshot stays cheap when hundreds of requests hold long private chains."""
    out: list[NodeSummary] = []
    rc = tree.pool.refcount
    p = tree.block_size
    budget = max_nodes

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
        out.append(NodeSummary(first.node_id, parent_id, first.block,
                               first.depth_tokens - p, last.depth_tokens, n,
                               max(count - 1, 0), first.hits, access, count <= 1,
                               first.on_host))
        stack.extend((c, first.node_id) for c in reversed(order(children.values())))
    return out

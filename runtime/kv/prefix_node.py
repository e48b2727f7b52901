"""The prefix tree's node record (`PrefixNode`: one cached full block), the default cost to
recompute a block, and the lazy LRU heap the tree picks its oldest leaves from. The tree
itself (lookup, insertion, eviction, demotion) is `kv/prefix_tree.py`."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

RecomputeCost = Callable[[int, int], float]
"""(tokens before the block, tokens in the block) -> seconds to recompute it."""


def break_even_hit_rate(t_recompute: float, t_fetch: float, t_upkeep: float) -> float:
    """The hit probability above which keeping a prefix saves time: `V_h = p_h·(T_r − T_f)
    − T_m > 0` exactly when `p_h > T_m / (T_r − T_f)` (docs/architecture.md, "Prefix
    retention"); infinite when a hit saves nothing."""
    gain = t_recompute - t_fetch
    return t_upkeep / gain if gain > 0 else float("inf")


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
    host_block: int = -1
    """The host block holding a demoted node's KV (−1: on the device, in `block`)."""
    local: tuple[int, ...] = ()
    """Its sliding-window pages, when the cache keeps them (`free_window_kv`)."""

    @property
    def on_host(self) -> bool:
        return self.host_block >= 0


def pop_oldest(heap: list[tuple[int, int, PrefixNode]], leaves: set[PrefixNode]
               ) -> PrefixNode:
    """Pop the least recently used of (non-empty) `leaves` from their lazy heap of (last
    access, id, node) entries: entries of nodes touched or gone since are skipped, and when
    every entry was stale the heap is rebuilt in place."""
    while True:
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if node in leaves and stamp == node.last_access:
                return node
        heap[:] = [(n.last_access, n.node_id, n) for n in leaves]
        heapq.heapify(heap)


def block_keys(tokens: list[int], block_size: int) -> list[tuple[int, ...]]:
    """The prefix tree's keys of the full blocks of `tokens`."""
    return [tuple(tokens[s:s + block_size]) for s in range(0, len(tokens) - block_size + 1,
                                                           block_size)]


def walk(root: PrefixNode, keys: list[tuple[int, ...]], num_blocks: int | None,
         known: list[PrefixNode] | None, nodes: dict[int, PrefixNode]) -> list[PrefixNode]:
    """The nodes under `root` along the blocks `keys` (at most `num_blocks`) while they are
    cached. `known`: an earlier walk of the same keys (a waiting request's last), gone on
    from its deepest node where that is still in the tree (`nodes`): only leaves are
    evicted, so then every node above it is too."""
    node: PrefixNode | None = root
    chain: list[PrefixNode] = []
    if known and known[0].parent is root and nodes.get(known[-1].node_id) is known[-1]:
        chain = known[:num_blocks]
        if len(chain) < len(known):
            return chain
        node = chain[-1]
    for key in keys[len(chain):num_blocks]:
        node = node.children.get(key)
        if node is None:
            break
        chain.append(node)
    return chain

"""The prefix tree as checkpoint data (`KVState.checkpoint_fields`, `KVState.restore`): its
nodes as rows and its counters, and the tree rebuilt from them in replay."""

from __future__ import annotations

from kvdeck.runtime.kv.prefix_tree import PrefixTree


def export_tree(tree: PrefixTree) -> tuple[list[list[int]], dict[str, int]]:
    """The tree as checkpoint data: [node id, parent id, block, end token, hits, last
    access, created lookup, host block, window pages] per node (parents first), and the
    counters."""
    nodes = [[n.node_id, n.parent.node_id if n.parent else 0,
              n.block, n.depth_tokens, n.hits, n.last_access, n.created_lookup,
              n.host_block, list(n.local)]
             for n in sorted(tree.nodes.values(), key=lambda n: n.node_id)]
    counters = {"lookups": tree.num_lookups, "query_tokens": tree.num_query_tokens,
                "hit_tokens": tree.num_hit_tokens, "evictions": tree.num_evictions,
                "demotions": tree.num_demotions, "promotions": tree.num_promotions,
                "host_hit_tokens": tree.num_host_hit_tokens}
    return nodes, counters


def load_tree(tree: PrefixTree, nodes: list[list[int]], counters: dict[str, int]) -> None:
    """Rebuild `tree`, empty, from `export_tree()` data (replay)."""
    for node_id, parent_id, block, _end, hits, last_access, created, *rest in nodes:
        # Older checkpoints end a row at `created lookup`: no host block, no window pages.
        host_block = rest[0] if rest else -1
        if host_block >= 0:  # demoted: enters on the device, then moves to the host
            tree.host_nodes_restore(node_id, parent_id, host_block, last_access, created)
        else:
            tree.restore(node_id, parent_id, block, last_access, created)
            if len(rest) > 1 and rest[1]:
                tree.attach_local(tree.nodes[node_id], rest[1], last_access)
        tree.nodes[node_id].hits = hits
    tree.num_lookups = counters["lookups"]
    tree.num_query_tokens = counters["query_tokens"]
    tree.num_hit_tokens = counters["hit_tokens"]
    tree.num_evictions = counters["evictions"]
    tree.num_demotions = counters.get("demotions", 0)
    tree.num_promotions = counters.get("promotions", 0)
    tree.num_host_hit_tokens = counters.get("host_hit_tokens", 0)

"""What the fleet screen draws from the replicas' caches: each replica's tree folded into
segments, one fleet tree keyed by content (so a prefix cached on two replicas is one node
with both marked), and what a longest-prefix router would score each replica for a prompt.

The router score follows llm-d's precise prefix-cache scorer: the prompt's full blocks, in
order, are looked up on each replica until the first miss; a block held on the device counts
1.0, one held only on the host (offloaded, medium `CPU`) 0.8. Lookups go by content key
(`replica_cache.content_key`), not by the replicas' own block hashes, which differ between
replicas unless they share `PYTHONHASHSEED` and the hash algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvdeck.runtime.fleet.replica_cache import DEVICE, Block, ReplicaCache, content_key

WEIGHTS = {DEVICE: 1.0, "CPU": 0.8}
"""Per-block weight by medium, as llm-d's scorer weighs GPU and CPU blocks."""


class Segment(NamedTuple):
    """A chain of blocks in which every block but the last has one child and all live in
    the same places (radix-style), as the prefix panel draws one line."""

    seg_id: int
    parent_id: int
    """The parent segment (0: a root)."""
    start_token: int | None
    """Position of its first token; None under a placeholder (the prefix is unknown)."""
    num_blocks: int
    block_size: int
    media: tuple[str, ...]
    groups: tuple[int | None, ...]
    placeholder: bool
    tokens: tuple[int, ...]
    """Its tokens (empty for a placeholder)."""

    @property
    def end_token(self) -> int | None:
        return None if self.start_token is None else \
            self.start_token + self.num_blocks * self.block_size


def segments(cache: ReplicaCache, limit: int = 256) -> list[Segment]:
    """Up to `limit` segments, depth first, larger subtrees first."""
    kids = cache.children()
    size = cache.block_size or 0
    weight: dict[int, int] = {}

    def subtree(b: Block) -> int:
        if b.block_hash not in weight:
            stack, order = [b], []
            while stack:  # iterative: a long chain must not hit the recursion limit
                n = stack.pop()
                order.append(n)
                stack.extend(kids.get(n.block_hash, ()))
            for n in reversed(order):
                weight[n.block_hash] = 1 + sum(weight[c.block_hash]
                                               for c in kids.get(n.block_hash, ()))
        return weight[b.block_hash]

    def place(b: Block) -> tuple:
        return tuple(sorted(b.media)), tuple(sorted(b.residency, key=lambda g: (g is None, g)))

    out: list[Segment] = []
    roots = sorted(cache.roots(), key=lambda b: -subtree(b))
    # Only a block that starts a sequence knows its position; the others' prefix is unknown.
    stack: list[tuple[Block, int, int | None]] = [
        (b, 0, 0 if b.parent is None and b.parent_known and not b.placeholder else None)
        for b in reversed(roots)]
    while stack and len(out) < limit:
        first, parent_id, start = stack.pop()
        chain = [first]
        while not chain[-1].placeholder:
            nxt = kids.get(chain[-1].block_hash, [])
            if len(nxt) != 1 or place(nxt[0]) != place(first) or nxt[0].placeholder:
                break
            chain.append(nxt[0])
        media, groups = place(first)
        tokens = () if first.placeholder else tuple(t for b in chain for t in b.tokens)
        seg = Segment(len(out) + 1, parent_id, start, len(chain), size, media, groups,
                      first.placeholder, tokens)
        out.append(seg)
        end = seg.end_token if not first.placeholder else None
        for child in sorted(kids.get(chain[-1].block_hash, []), key=lambda b: subtree(b)):
            stack.append((child, seg.seg_id, end))
    return out


@dataclass
class FleetNode:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    replicas: dict[str, set[str]] = field(default_factory=dict)
    """Replica name -> media holding the block there."""


def fleet_tree(caches: dict[str, ReplicaCache]) -> dict[bytes, FleetNode]:
    """Every block whose prefix is known, keyed by content, with the replicas holding it."""
    nodes: dict[bytes, FleetNode] = {}
    for name, cache in caches.items():
        for b in cache.blocks.values():
            key = cache.key(b.block_hash)
            if key is None:
                continue  # under a placeholder: not comparable across replicas
            parent = cache.key(b.parent) if b.parent is not None else None
            node = nodes.setdefault(key, FleetNode(key, parent, b.tokens))
            node.replicas[name] = set(b.media)
    return nodes


class Score(NamedTuple):
    blocks: int
    """Prompt blocks found in a row from the start."""
    score: float
    """Their weighted sum (device 1.0, host 0.8)."""
    tokens: int
    """Prompt tokens those blocks cover."""


def router_scores(caches: dict[str, ReplicaCache], prompt: list[int]) -> dict[str, Score]:
    """What a longest-prefix router scores each replica for `prompt` (module docstring)."""
    out = {}
    for name, cache in caches.items():
        size = cache.block_size
        if not size:
            out[name] = Score(0, 0.0, 0)
            continue
        by_key: dict[bytes, set[str]] = {}
        for b in cache.blocks.values():
            key = cache.key(b.block_hash)
            if key is not None:
                by_key.setdefault(key, set()).update(b.media)
        key, blocks, score = None, 0, 0.0
        for start in range(0, len(prompt) - size + 1, size):
            key = content_key(key, tuple(prompt[start:start + size]), None)
            media = by_key.get(key)
            if not media:
                break
            blocks += 1
            score += max(WEIGHTS.get(m, 0.0) for m in media)
        out[name] = Score(blocks, score, blocks * size)
    return out


class FleetSegment(NamedTuple):
    """A chain of fleet nodes held by the same replicas the same way, as one line."""

    seg_id: int
    parent_id: int
    start_token: int
    num_tokens: int
    num_blocks: int
    replicas: tuple[tuple[str, tuple[str, ...]], ...]
    """(replica, media) for each replica holding it, by name."""
    tokens: tuple[int, ...]


def fleet_segments(nodes: dict[bytes, FleetNode], limit: int = 256) -> list[FleetSegment]:
    """The fleet tree folded radix-style, depth first, the most widely held first."""
    kids: dict[bytes | None, list[FleetNode]] = {}
    for n in nodes.values():
        kids.setdefault(n.parent if n.parent in nodes else None, []).append(n)

    def held(n: FleetNode) -> tuple:
        return tuple(sorted((r, tuple(sorted(m))) for r, m in n.replicas.items()))

    def order(ns: list[FleetNode]) -> list[FleetNode]:
        return sorted(ns, key=lambda n: (-len(n.replicas), n.tokens))

    out: list[FleetSegment] = []
    stack = [(n, 0, 0) for n in reversed(order(kids.get(None, [])))]
    while stack and len(out) < limit:
        first, parent_id, start = stack.pop()
        chain = [first]
        while len(kids.get(chain[-1].key, [])) == 1 and \
                held(kids[chain[-1].key][0]) == held(first):
            chain.append(kids[chain[-1].key][0])
        tokens = tuple(t for n in chain for t in n.tokens)
        seg = FleetSegment(len(out) + 1, parent_id, start, len(tokens), len(chain),
                           held(first), tokens)
        out.append(seg)
        for child in reversed(order(kids.get(chain[-1].key, []))):
            stack.append((child, seg.seg_id, start + len(tokens)))
    return out

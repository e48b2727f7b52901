"""One replica's prefix cache as its KV events tell it, and what they cannot tell.

Blocks are keyed by the replica's own block hash. Each knows its parent, its tokens and
where it lives: per KV-cache group (a hybrid model stores one block hash once per group),
the media holding it (`GPU`, `CPU` for offload). A block whose parent was stored before the
subscriber connected hangs under a placeholder that says so. A block also gets a content
key — a hash of its tokens chained from the root — so the same prefix on two replicas,
whose engine hashes differ unless they share `PYTHONHASHSEED` and the hash algorithm, is
one node of the fleet tree (`fleet_tree.py`).

Sequence numbers are checked: a message after a gap marks the missing range (refilled from
the replay endpoint when there is one: `subscriber.py`), an old one (a replay's overlap) is
dropped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvdeck.runtime.fleet.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

DEVICE = "GPU"
"""The medium a store that names none is on (vLLM's default)."""


@dataclass
class Block:
    block_hash: int
    parent: int | None
    tokens: tuple[int, ...] | None
    """None for a placeholder: a parent stored before the subscriber connected."""
    residency: dict[int | None, set[str]] = field(default_factory=dict)
    """KV-cache group -> media holding the block in that group."""
    lora_name: str | None = None
    parent_known: bool = True
    """False while only a sliding-window group has stored it with the blocks before it left
    out (they slid out of its window): its parent is not said until another group's store."""

    @property
    def placeholder(self) -> bool:
        return self.tokens is None

    @property
    def media(self) -> set[str]:
        return set().union(*self.residency.values()) if self.residency else set()


def content_key(parent_key: bytes | None, tokens: tuple[int, ...], lora: str | None) -> bytes:
    """A block's content key: its tokens (and adapter) chained after its parent's key."""
    h = hashlib.blake2b(parent_key or b"root", digest_size=16)
    if lora:
        h.update(lora.encode())
    h.update(b"|".join(str(t).encode() for t in tokens))
    return h.digest()


class ReplicaCache:
    """Applies one replica's event batches in sequence order."""

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}
        self.block_size: int | None = None
        self.next_seq: int | None = None
        """The sequence number expected next (None: nothing seen yet)."""
        self.gaps: list[tuple[int, int]] = []
        """Missing message ranges [first, last] not refilled."""
        self.batches = 0
        self.clears = 0
        self.last_ts: float | None = None
        self._keys: dict[int, bytes | None] = {}

    # -- applying ---------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> bool:
        """Apply one batch; False if it was already applied (an old sequence number)."""
        if self.next_seq is not None and batch.seq < self.next_seq:
            return False
        if self.next_seq is not None and batch.seq > self.next_seq:
            self.gaps.append((self.next_seq, batch.seq - 1))
        self.next_seq = batch.seq + 1
        self.batches += 1
        self.last_ts = batch.ts
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
                self.clears += 1
        self._keys.clear()
        return True

    def refilled(self, first: int, last: int) -> None:
        """Messages first..last came from the replay endpoint: no longer a gap."""
        self.gaps = [g for g in self.gaps if not (first <= g[0] and g[1] <= last)]

    def _stored(self, ev: BlockStored) -> None:
        self.block_size = ev.block_size
        blocks = ev.blocks
        # A sliding-window group leaves out the blocks that slid out of its window; then the
        # first block it lists follows one it did not list, and `parent` says nothing of it.
        known = len(ev.token_ids) // ev.block_size == len(blocks)
        parent = ev.parent if known else None
        if parent is not None and parent not in self.blocks:
            self.blocks[parent] = Block(parent, None, None)
        medium = ev.medium or DEVICE
        for h, tokens in blocks:
            b = self.blocks.get(h)
            if b is None or b.placeholder:
                b = self.blocks[h] = Block(h, parent, tokens, b.residency if b else {},
                                           ev.lora_name, known)
            elif known and not b.parent_known:
                b.parent, b.parent_known = parent, True
            b.residency.setdefault(ev.group, set()).add(medium)
            parent, known = h, True

    def _removed(self, ev: BlockRemoved) -> None:
        medium = ev.medium or DEVICE
        for h in ev.block_hashes:
            b = self.blocks.get(h)
            if b is None:
                continue
            media = b.residency.get(ev.group)
            if media is not None:
                media.discard(medium)
                if not media:
                    del b.residency[ev.group]
            if not b.residency:
                del self.blocks[h]

    # -- reading ----------------------------------------------------------------------------

    def key(self, block_hash: int) -> bytes | None:
        """The block's content key; None under a placeholder (its prefix is unknown)."""
        if block_hash in self._keys:
            return self._keys[block_hash]
        chain, h = [], block_hash
        while h is not None and h not in self._keys:
            b = self.blocks.get(h)
            if b is None or b.placeholder:
                break
            chain.append(b)
            h = b.parent
        key = self._keys.get(h) if h is not None else None
        known = h is None or (h in self._keys and key is not None)
        for b in reversed(chain):
            key = content_key(key, b.tokens, b.lora_name) if known else None
            self._keys[b.block_hash] = key
        return self._keys.get(block_hash)

    def roots(self) -> list[Block]:
        """Blocks with no parent here: the starts of sequences, placeholders (stored before
        we connected), and blocks whose parent was removed first."""
        return [b for b in self.blocks.values() if b.parent is None or b.parent not in
                self.blocks]

    def children(self) -> dict[int | None, list[Block]]:
        out: dict[int | None, list[Block]] = {}
        for b in self.blocks.values():
            out.setdefault(b.parent, []).append(b)
        return out

    def resident(self, medium: str = DEVICE) -> int:
        """Blocks held on `medium` (in any group)."""
        return sum(1 for b in self.blocks.values() if medium in b.media)

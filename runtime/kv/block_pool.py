"""A fixed pool of KV blocks with reference counts.

A block's reference count is the number of block-table entries pointing at it plus one if
the prefix cache holds it. A block with count 0 is free. The pool also knows which blocks the
prefix cache holds, so it can count the cached blocks no request uses (evictable) without
asking the tree.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Physical KV blocks `0 .. num_blocks-1`, their refcounts and the free list."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount: list[int] = [0] * num_blocks
        self.cached = bytearray(num_blocks)
        """1 where the prefix cache holds the block."""
        self._free: deque[int] = deque(range(num_blocks))
        self.num_cached_only = 0
        """Cached blocks whose only reference is the cache: evictable."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_take(self) -> bool:
        return bool(self._free)

    def take(self) -> int:
        """Remove a free block from the pool with refcount 1; the caller checks `can_take`."""
        block = self._free.popleft()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        rc = self.refcount[block]
        if self.cached[block] and rc == 1:
            self.num_cached_only -= 1
        self.refcount[block] = rc + 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when that returned the block to the free list."""
        rc = self.refcount[block] - 1
        self.refcount[block] = rc
        if rc == 0:
            if self.cached[block]:
                self.cached[block] = 0
                self.num_cached_only -= 1
            self._free.append(block)
            return True
        if rc == 1 and self.cached[block]:
            self.num_cached_only += 1
        return False

    def mark_cached(self, block: int) -> None:
        """The prefix cache takes a reference on `block`."""
        rc = self.refcount[block] + 1
        self.refcount[block] = rc
        self.cached[block] = 1
        if rc == 1:
            self.num_cached_only += 1

    def unmark_cached(self, block: int) -> bool:
        """The prefix cache drops its reference; True when the block became free."""
        if self.refcount[block] == 1:
            self.num_cached_only -= 1
        self.cached[block] = 0
        return self.decref(block)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free list, refcounts and cache flags agree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            rc = self.refcount[b]
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc}, free={b in free}"
            assert not (self.cached[b] and rc == 0), f"block {b} is cached but unreferenced"
        cached_only = sum(1 for b in range(self.num_blocks)
                          if self.cached[b] and self.refcount[b] == 1)
        assert cached_only == self.num_cached_only, \
            f"evictable count {self.num_cached_only} != actual {cached_only}"
        assert self.num_free + self.num_used == self.num_blocks

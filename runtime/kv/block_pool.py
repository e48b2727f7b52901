"""A fixed pool of KV blocks with reference counts and a packed per-block state array.

A block's reference count is the number of block-table entries pointing at it plus one if
the prefix cache holds it. A block with count 0 is free. The pool also knows which blocks the
prefix cache holds, so it can count the cached blocks no request uses (evictable) without
asking the tree.

Every change also updates `states`, one byte per block, in place — the block map that
snapshots copy (a copy of a bytearray, not a pass over the pool):

    FREE 0           no reference
    PRIVATE 1        one request uses it, not in the prefix cache
    SHARED 2         two or more requests use it
    CACHED 3         only the prefix cache holds it: evictable
    CACHED_ACTIVE 4  in the prefix cache and used by one request

`BlockStates` is the accounting alone (replay rebuilds it from KV events); `BlockPool` adds
the free list that allocation picks blocks from. Neither decides anything: `KVState.apply`
is the only code that changes them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

FREE, PRIVATE, SHARED, CACHED, CACHED_ACTIVE = range(5)
STATE_NAMES = ("free", "private", "shared", "cached", "cached_active")

# _CODE[cached][min(refcount, 3)]: the state of a block (a cached block's own reference is
# the cache's, so its users are refcount − 1).
_CODE = ((FREE, PRIVATE, SHARED, SHARED), (FREE, CACHED, CACHED_ACTIVE, SHARED))
_CODES = np.array(_CODE, dtype=np.uint8)


class BlockStates:
    """Refcounts, cache flags and packed states of blocks `0 .. num_blocks-1`."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount: list[int] = [0] * num_blocks
        self.cached = bytearray(num_blocks)
        """1 where the prefix cache holds the block."""
        self.states = bytearray(num_blocks)
        """One state code per block (FREE … CACHED_ACTIVE), kept current in place."""
        self.num_free = num_blocks
        self.num_cached_only = 0
        """Cached blocks whose only reference is the cache: evictable."""
        self.cache_version = 0
        """Bumped whenever a cached block's references change (snapshots reuse their
        prefix-tree summary while it stands still)."""

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_held(self) -> int:
        """Blocks some request holds (vLLM's KV usage counts these): used minus evictable."""
        return self.num_blocks - self.num_free - self.num_cached_only

    def incref(self, block: int) -> None:
        rc = self.refcount[block] + 1
        self.refcount[block] = rc
        c = self.cached[block]
        if rc == 1:
            self.num_free -= 1
            self._taken(block)
        elif c:
            self.cache_version += 1
            if rc == 2:
                self.num_cached_only -= 1
        self.states[block] = _CODE[c][rc if rc < 3 else 3]

    def decref(self, block: int) -> bool:
        """Drop one reference; True when that freed the block."""
        rc = self.refcount[block] - 1
        self.refcount[block] = rc
        if rc == 0:
            if self.cached[block]:
                self.cached[block] = 0
                self.num_cached_only -= 1
                self.cache_version += 1
            self.num_free += 1
            self.states[block] = FREE
            self._freed(block)
            return True
        c = self.cached[block]
        if c:
            self.cache_version += 1
            if rc == 1:
                self.num_cached_only += 1
        self.states[block] = _CODE[c][rc if rc < 3 else 3]
        return False

    def _freed(self, block: int) -> None:
        """Hook: `block` just became free."""

    def _taken(self, block: int) -> None:
        """Hook: free `block` just took its first reference."""

    def mark_cached(self, block: int) -> None:
        """The prefix cache takes a reference on `block`."""
        self.cached[block] = 1
        rc = self.refcount[block] + 1
        self.refcount[block] = rc
        if rc == 1:
            self.num_free -= 1
            self.num_cached_only += 1
            self._taken(block)
        self.states[block] = _CODE[1][rc if rc < 3 else 3]

    def unmark_cached(self, block: int) -> bool:
        """The prefix cache drops its reference; True when the block became free."""
        if self.refcount[block] == 1:
            self.num_cached_only -= 1
        self.cached[block] = 0
        return self.decref(block)

    def relayout(self, num_blocks: int, moves: dict[int, int]) -> None:
        """Resize to `num_blocks`, first moving each used block `old` to the free id
        `moves[old]`; afterwards no used block may lie at or beyond `num_blocks`."""
        rc, cached, states = self.refcount, self.cached, self.states
        for old, new in moves.items():
            assert rc[new] == 0 and rc[old] > 0, f"cannot move block {old} onto {new}"
            rc[new], cached[new], states[new] = rc[old], cached[old], states[old]
            rc[old], cached[old], states[old] = 0, 0, FREE
        grow = num_blocks - self.num_blocks
        if grow < 0:
            assert not any(rc[num_blocks:]), "a used block lies past the new pool's end"
            del rc[num_blocks:], cached[num_blocks:], states[num_blocks:]
        else:
            rc.extend([0] * grow)
            cached.extend(bytes(grow))
            states.extend(bytes(grow))
        self.num_free += grow
        self.num_blocks = num_blocks
        self.cache_version += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of refcounts, cache flags and states as arrays, for checks that look at
        every block (copies: a view would pin the bytearrays' size)."""
        return (np.array(self.refcount, dtype=np.int64),
                np.frombuffer(bytes(self.cached), dtype=np.uint8),
                np.frombuffer(bytes(self.states), dtype=np.uint8))

    def check_integrity(self) -> None:
        """Raise AssertionError unless refcounts, cache flags, states and counts agree."""
        # Whole-array comparisons: tests check after every step, on pools of up to a card's
        # tens of thousands of blocks, where a Python loop over every block cost a fleet
        # test a sixth of its time.
        rc, cached, states = self.arrays()
        bad = np.flatnonzero(rc < 0)
        assert not bad.size, f"block {bad[0]} has negative refcount {rc[bad[0]]}"
        bad = np.flatnonzero((cached != 0) & (rc == 0))
        assert not bad.size, f"block {bad[0]} is cached but unreferenced"
        bad = np.flatnonzero(states != _CODES[cached, np.minimum(rc, 3)])
        assert not bad.size, \
            f"block {bad[0]}: state {states[bad[0]]} disagrees with refcount {rc[bad[0]]}"
        assert self.num_free == int((rc == 0).sum()), "free count disagrees with refcounts"
        cached_only = int(((cached != 0) & (rc == 1)).sum())
        assert cached_only == self.num_cached_only, \
            f"evictable count {self.num_cached_only} != actual {cached_only}"


class BlockPool(BlockStates):
    """`BlockStates` plus the free list allocation takes blocks from."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_listed(self) -> int:
        """Blocks on the free list (allocation order)."""
        return len(self._free)

    def pick(self, n: int) -> list[int]:
        """The next `n` free blocks allocation would take, without taking them: the caller
        applies the KV event that references them (`KVState.apply`), which takes them off
        the free list in this order. The caller makes sure `num_listed >= n`."""
        free = self._free
        return [free[0]] if n == 1 else [free[i] for i in range(n)]

    def _freed(self, block: int) -> None:
        self._free.append(block)

    def _taken(self, block: int) -> None:
        free = self._free
        if free[0] == block:  # always, when the picked blocks are referenced in order
            free.popleft()
        else:
            free.remove(block)

    def relayout(self, num_blocks: int, moves: dict[int, int]) -> None:
        super().relayout(num_blocks, moves)
        self._free = deque(b for b in range(num_blocks) if self.refcount[b] == 0)

    def check_integrity(self) -> None:
        super().check_integrity()
        free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        assert np.unique(free).size == free.size, "a block is on the free list twice"
        assert free.size == self.num_free, "free list disagrees with the free count"
        rc = np.array(self.refcount, dtype=np.int64)
        assert not rc[free].any(), "a referenced block is on the free list"

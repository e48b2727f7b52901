"""The host KV tier: blocks of KV in host memory (pinned on CUDA), beside the device pool.

Two things live there, and nothing else:

- **swapped** blocks: the computed KV of a request preempted by swap (`preemption = swap`
  or `auto`), held until it is readmitted and its blocks are copied back;
- **demoted** blocks: prefix-cache blocks evicted from the device and kept on the host
  instead of dropped, until a hit promotes them back (a *host hit*) or the host tier needs
  the room.

Attention never reads a host block: a swapped request runs only after its blocks are back,
and a demoted block is promoted before the admission that hits it runs. Host block ids are
their own space (`0 .. num_blocks-1`); `HostTier` is accounting only — free list, one state
byte per block and counts — and the executor holds the bytes. Live and replay both occupy
blocks by the ids their KV events name (`KVState.apply`); the live manager `pick`s them first.

Capacity is `host_kv_memory_bytes / bytes per block`; a KV format change empties the tier
and re-lays it at the new block size (`BlockManager.drop_host_tier`).
"""

from __future__ import annotations

from collections import deque

import numpy as np

HOST_FREE, HOST_SWAPPED, HOST_DEMOTED = 0, 1, 2
HOST_STATE_NAMES = ("free", "swapped", "demoted")


class HostTier:
    """Host blocks `0 .. num_blocks-1`: which are free, swapped or demoted."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.states = bytearray(num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self.num_swapped = 0
        self.num_demoted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_swapped + self.num_demoted

    def pick(self, n: int) -> list[int]:
        """The next `n` free host blocks, without taking them (the KV event that occupies
        them is applied next, in this order); the caller checks `num_free` first."""
        free = self._free
        return [free[i] for i in range(n)]

    def occupy(self, block: int, state: int) -> None:
        """Take the named free block into `state` (HOST_SWAPPED or HOST_DEMOTED)."""
        assert self.states[block] == HOST_FREE, f"host block {block} is not free"
        free = self._free
        if free[0] == block:  # a picked block, taken in order
            free.popleft()
        else:
            free.remove(block)
        self._set(block, state)

    def _set(self, block: int, state: int) -> None:
        self.states[block] = state
        if state == HOST_SWAPPED:
            self.num_swapped += 1
        else:
            self.num_demoted += 1

    def free(self, block: int) -> None:
        state = self.states[block]
        assert state != HOST_FREE, f"host block {block} freed twice"
        if state == HOST_SWAPPED:
            self.num_swapped -= 1
        else:
            self.num_demoted -= 1
        self.states[block] = HOST_FREE
        self._free.append(block)

    def resize(self, num_blocks: int) -> None:
        """Re-lay an empty tier as `num_blocks` blocks (a new block size in bytes)."""
        assert self.num_used == 0, "only an empty host tier is re-laid"
        self.num_blocks = num_blocks
        self.states = bytearray(num_blocks)
        self._free = deque(range(num_blocks))

    def check_integrity(self) -> None:
        """Raise AssertionError unless states, free list and counts agree."""
        free = np.unique(np.fromiter(self._free, dtype=np.int64, count=len(self._free)))
        assert free.size == len(self._free), "a host block is on the free list twice"
        marked = np.flatnonzero(np.frombuffer(bytes(self.states), np.uint8) == HOST_FREE)
        bad = np.setxor1d(marked, free)
        assert not bad.size, f"host block {bad[0]}: its state and the free list disagree"
        assert self.num_swapped == self.states.count(HOST_SWAPPED)
        assert self.num_demoted == self.states.count(HOST_DEMOTED)
        assert self.num_free + self.num_used == self.num_blocks, "host blocks do not add up"

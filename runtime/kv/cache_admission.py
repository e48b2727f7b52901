"""Prefix-cache admission: which completed blocks may enter the prefix cache at all.

Eviction decides what leaves the cache; admission decides what enters it. Admitting every
completed block (`k = 1`, the default) lets a burst of one-off prompts flush a hot system
prompt out of a small cache. With `k ≥ 2` a block enters only when its prefix — the whole
token sequence up to and including the block, not the block's tokens alone — was in the
prompts of at least `k` of the last `window` requests admitted (first admissions only;
preempted requests coming back are not counted again), so one-off prompts stay private and
are freed with their request, while prefixes that recur are cached from their `k`-th
sighting on. Blocks that are already cached are always shared: admission only gates new
nodes.

A prefix is identified by a rolling hash over its blocks, `h_{j+1} = hash((h_j, block_j))`
from the namespace, so each admission costs one hash per prompt block.
"""

from __future__ import annotations

from collections import Counter, deque


class CacheAdmission:
    """Counts prefix sightings over a window of admitted requests."""

    def __init__(self, k: int = 1, window: int = 1024):
        self.k = k
        self.window = window
        self._seen: Counter[int] = Counter()
        self._recent: deque[tuple[int, ...]] = deque()
        """Prefix hashes of each request in the window, oldest first."""
        self._hashes: dict[str, list[int]] = {}
        """Per running request: the rolling hash of its prefix at each full block."""

    def configure(self, k: int, window: int) -> None:
        """Take new knob values; a shorter window forgets its oldest sightings."""
        self.k, self.window = k, window
        if k <= 1:
            self._seen.clear()
            self._recent.clear()
            self._hashes.clear()
        while len(self._recent) > window:
            self._expire()

    def _expire(self) -> None:
        for h in self._recent.popleft():
            self._seen[h] -= 1
            if not self._seen[h]:
                del self._seen[h]

    def on_admit(self, request_id: str, namespace: str, blocks: list[tuple[int, ...]],
                 first: bool) -> None:
        """A request was admitted with these full prompt blocks; `first`: not a
        readmission (only first admissions count as sightings)."""
        if self.k <= 1:
            return
        h = hash(namespace)
        hashes = []
        for key in blocks:
            h = hash((h, key))
            hashes.append(h)
        self._hashes[request_id] = hashes
        if first:
            self._recent.append(tuple(hashes))
            self._seen.update(hashes)
            while len(self._recent) > self.window:
                self._expire()

    def allows(self, request_id: str, index: int, key: tuple[int, ...],
               namespace: str) -> bool:
        """May block `index` of this request, holding `key`, enter the cache? Blocks are
        asked about in order, so a block past the prompt (an output's) extends the rolling
        hash of the one before it."""
        if self.k <= 1:
            return True
        hashes = self._hashes.setdefault(request_id, [])
        if index == len(hashes):
            hashes.append(hash((hashes[-1] if hashes else hash(namespace), key)))
        return self._seen.get(hashes[index], 0) >= self.k

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

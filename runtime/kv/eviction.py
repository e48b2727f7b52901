"""Token-level KV eviction for contexts past the budget (`--kv-eviction`): lossy, off by
default, torch executor.

Both modes work in whole blocks. An evicted block leaves a hole (−1) in its request's
table and returns to the pool. Attention then reads the blocks left, each key at the
position it was computed at.

- `sink-window` (StreamingLLM, Xiao et al. 2023) keeps the first `sink_tokens` (rounded up
  to blocks: the attention sinks) and the `recent_tokens` before the next position. Every
  block between them is evicted after each step.
- `heavy-hitter` (H2O, Zhang et al. 2023) keeps the sinks, the recent window and up to
  `heavy_tokens` more: the blocks that have drawn the most attention. Every step the
  executor reports the attention each request's queries put on each block it read
  (softmax weights summed over heads, query rows and layers). The sums accumulate per block.
  A block leaving the recent window stays while it is among the heaviest; past the budget
  the lightest goes.

Eviction runs between steps. A prefill chunk therefore reads what its request kept when the
chunk started, plus the chunk itself, so with chunked prefill the loss depends on the chunk
size.

Positions: keys keep the rotary positions they were computed at. StreamingLLM renumbers
positions inside the cache so that a model can run past its trained context. kvdeck keeps
every request inside the model's context (`max_model_len`), where the original positions
are the ones the model was trained on, so nothing is renumbered.

Prefix caching: a request long enough to evict (more than sink + recent tokens, prompt
and output) neither reuses nor feeds the prefix cache; shorter requests cache and reuse as
always. Three reasons:
- The tree's accounting needs every cached block a request holds to have its parent held
  too, and eviction drops blocks from the middle.
- Past the sinks, its blocks may be computed over an incomplete context, and approximate
  KV must not be served as exact.
- A hit would shift where its prefill chunks fall, and with them what is evicted: the
  same prompt would answer differently with a warm cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.events import Drop
from kvdeck.runtime.kv.state import KVState

EVICTION_MODES = ("off", "sink-window", "heavy-hitter")


@dataclass(frozen=True)
class Eviction:
    """What a request keeps of its KV under token-level eviction, in tokens."""

    mode: str = "off"
    sink_tokens: int = 4
    recent_tokens: int = 512
    heavy_tokens: int = 256
    """Heavy-hitter mode only: tokens kept beyond the sinks and the recent window."""

    def check(self, block_size: int) -> None:
        """A ConfigError sentence unless the mode is known and the sizes make sense."""
        if self.mode not in EVICTION_MODES:
            raise ConfigError(f"kv_eviction must be one of {', '.join(EVICTION_MODES)}, got "
                              f"{self.mode!r}.")
        for name, value, lo in (("kv_sink_tokens", self.sink_tokens, 0),
                                ("kv_recent_tokens", self.recent_tokens, block_size),
                                ("kv_heavy_tokens", self.heavy_tokens, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or \
                    not lo <= value <= 1 << 24:
                raise ConfigError(f"{name} must be an integer from {lo:,} to {1 << 24:,} "
                                  f"(the recent window holds at least one block of "
                                  f"{block_size} tokens), got {value!r}.")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def kept_blocks(self, block_size: int) -> int:
        """Blocks a request keeps between steps at most: sinks, the recent window (one
        more when it straddles a block boundary) and, in heavy-hitter mode, the heavy
        blocks."""
        p = block_size
        heavy = -(-self.heavy_tokens // p) if self.mode == "heavy-hitter" else 0
        return -(-self.sink_tokens // p) + -(-self.recent_tokens // p) + 1 + heavy

    def describe(self) -> str:
        """A few words for the KV map's legend and logs."""
        if not self.on:
            return "off"
        heavy = f" + {self.heavy_tokens:,} heaviest" if self.mode == "heavy-hitter" else ""
        return (f"{self.mode}: {self.sink_tokens:,} sink + {self.recent_tokens:,} recent"
                f"{heavy} tokens kept")


class TokenEvictor:
    """The eviction decisions of one `BlockManager` (composed, like `WindowTables`): it
    reads `state` and changes it only through `apply`. Every method is a no-op with
    eviction off."""

    def __init__(self, policy: Eviction, state: KVState, apply: Callable[[Drop], None]):
        self.policy = policy
        self.on = policy.on
        self.state = state
        self.apply = apply
        p = state.block_size
        self.sink_blocks = -(-policy.sink_tokens // p)
        self.heavy_blocks = -(-policy.heavy_tokens // p) if policy.mode == "heavy-hitter" \
            else 0
        self.decided: dict[str, int] = {}
        """Per request: blocks before this index are evicted or kept as heavy hitters."""
        self.heavy: dict[str, list[int]] = {}
        """Per request (heavy-hitter): the table indices kept as heavy hitters."""
        self.scores: dict[str, dict[int, float]] = {}
        """Per request (heavy-hitter): accumulated attention per table index."""
        self.num_evicted_blocks = 0
        """Blocks evicted since the engine started."""

    def bound(self, num_tokens: int, chunk_size: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at its largest, computing
        `chunk_size` tokens a step: what it keeps plus the next chunk's blocks (one more
        when the chunk straddles a boundary)."""
        p = self.state.block_size
        blocks = -(-num_tokens // p)
        if not self.on:
            return blocks
        return min(blocks, self.policy.kept_blocks(p) + -(-min(chunk_size, num_tokens) // p)
                   + 1)

    def shares_prefix(self, req: Request) -> bool:
        """Whether the prefix cache may give `req` blocks or take its blocks: not when it is
        long enough to evict (the module docstring says why)."""
        return not self.on or req.max_total_tokens <= \
            self.sink_blocks * self.state.block_size + self.policy.recent_tokens

    def after_step(self, req: Request, scores: list[float] | None) -> None:
        """Evict what `req` no longer keeps, given the attention its rows put on each block
        of its table this step (`scores`, heavy-hitter mode; index order)."""
        if not self.on:
            return
        rid = req.request_id
        table = self.state.tables.get(rid)
        if not table:
            return
        p = self.state.block_size
        q = req.num_computed_tokens
        # Blocks holding any of the last `recent_tokens` before q stay, and so does the
        # table's last block (it may be partly written).
        first_recent = min(max(0, q - self.policy.recent_tokens) // p, len(table) - 1)
        start = max(self.decided.get(rid, 0), self.sink_blocks)
        if first_recent <= start and not scores:
            return
        acc = self.scores.setdefault(rid, {}) if self.heavy_blocks else None
        if acc is not None:
            for k, s in enumerate(scores or ()):
                if s:
                    acc[k] = acc.get(k, 0.0) + s
        new = list(range(start, first_recent))  # undecided blocks are never holes
        if acc is None:
            victims = new
        else:  # the heaviest stay; ties go to the later block
            candidates = self.heavy.get(rid, []) + new
            ranked = sorted(candidates, key=lambda k: (acc.get(k, 0.0), k), reverse=True)
            self.heavy[rid] = sorted(ranked[:self.heavy_blocks])
            victims = sorted(ranked[self.heavy_blocks:])
        self.decided[rid] = max(start, first_recent)
        for k in victims:
            self.apply(Drop(rid, k, table[k]))
            if acc is not None:
                acc.pop(k, None)
        self.num_evicted_blocks += len(victims)

    def fork(self, parent: str, child: str) -> None:
        """`child` shares `parent`'s table, holes included: it inherits what was decided."""
        if parent in self.decided:
            self.decided[child] = self.decided[parent]
        if parent in self.heavy:
            self.heavy[child] = list(self.heavy[parent])
            self.scores[child] = dict(self.scores.get(parent, {}))

    def forget(self, rid: str) -> None:
        """`rid` released its blocks (finished, or preempted to recompute from scratch)."""
        for d in (self.decided, self.heavy, self.scores):
            d.pop(rid, None)

    def describe(self) -> str:
        """The policy and what it has evicted, for the KV map ("" when off)."""
        if not self.on:
            return ""
        n = self.num_evicted_blocks
        return f"eviction {self.policy.describe()} · {n:,} block{'s' * (n != 1)} evicted"


def evicted_ranges(table: list[int] | tuple[int, ...], block_size: int
                   ) -> list[tuple[int, int]]:
    """The token ranges `(first, end)` a block table's holes stand for (−1 entries)."""
    out: list[tuple[int, int]] = []
    for k, b in enumerate(table):
        if b < 0:
            if out and out[-1][1] == k * block_size:
                out[-1] = (out[-1][0], (k + 1) * block_size)
            else:
                out.append((k * block_size, (k + 1) * block_size))
    return out

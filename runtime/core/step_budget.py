"""Token budget from an inter-token-latency target: the chapter's two-step rule.

Every running request that decodes gets one token in each step, so a step's time is the
inter-token latency (ITL) they all see. A fixed token budget lets a long prompt's chunk
stretch that step; a target fixes the step time instead and derives the tokens from it:

1. **target → step time:** the step may take at most `itl_target_ms`;
2. **step time → new tokens:** with the step's decode rows planned first, each prefill
   chunk gets the largest token count `n` for which the executor's timing model predicts
   `T(new + n, pairs + c(n, s), context + s + n) ≤ target`, where `c(n, s) = n·s +
   n(n+1)/2` are the causal pairs of `n` tokens on top of `s` (`step_data.causal_pairs`), and
   `new`, `pairs`, `context` are the sums over the chunks planned so far. The count is
   found by bisection (the model grows with `n`).

A prefill always advances: when not even one token fits (the decode rows alone reach the
target), the step's first prefill chunk still gets one block (`block_size` tokens, or what
is left of its prompt), so a decode load above the target slows that prompt but never
starves it. The plan records the target and the prediction (`SchedulerOutput.itl_target_s`,
`predicted_s`), which go into the iteration trace.
"""

from __future__ import annotations

from kvdeck.runtime.core.step_data import Estimator, ScheduledChunk, causal_pairs


class StepTotals:
    """The sums the timing model takes, over the chunks of a plan."""

    def __init__(self, estimate: Estimator, chunks: list[ScheduledChunk]):
        self.estimate = estimate
        self.new = sum(c.num_new_tokens for c in chunks)
        self.pairs = sum(c.num_pairs for c in chunks)
        self.context = sum(c.start + c.num_new_tokens for c in chunks)

    def seconds(self) -> float:
        """The predicted step time of what is planned."""
        return self.estimate(self.new, self.pairs, self.context)

    def with_chunk(self, start: int, n: int) -> float:
        """The predicted step time if a chunk of `n` tokens from `start` joined."""
        return self.estimate(self.new + n, self.pairs + causal_pairs(n, start),
                             self.context + start + n)

    def add(self, start: int, n: int, prefill: bool = True) -> None:
        """A chunk of `n` tokens from `start` joins the step (`prefill`: not a decode row)."""
        self.new += n
        self.pairs += causal_pairs(n, start)
        self.context += start + n


class StepBudget(StepTotals):
    """Sizes a step's prefill chunks so its predicted time stays within `target_s`."""

    def __init__(self, estimate: Estimator, chunks: list[ScheduledChunk], target_s: float,
                 block_size: int):
        super().__init__(estimate, chunks)
        self.target_s = target_s
        self.block_size = block_size
        self.num_prefills = 0

    def cap(self, start: int, want: int) -> int:
        """The most of `want` tokens from `start` a chunk may take (0: none this step)."""
        if want <= 0 or self.with_chunk(start, want) <= self.target_s:
            return max(want, 0)
        lo, hi = 0, want - 1  # the largest n in [0, want) that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.with_chunk(start, mid) <= self.target_s:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 and self.num_prefills == 0:
            return min(want, self.block_size)  # a prefill always advances
        return lo

    def add(self, start: int, n: int, prefill: bool = True) -> None:
        super().add(start, n, prefill)
        self.num_prefills += prefill

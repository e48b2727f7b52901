"""The sim's modelled draft model (`draft_cost` above 0): what its passes add to a step."""

from __future__ import annotations

from collections.abc import Callable

from kvdeck.runtime.core.step_data import SchedulerOutput

Estimate = Callable[[int, int, int], float]
"""(new tokens, causal pairs, positions read) -> seconds of one target pass
(`SimExecutor.estimate_step_seconds`)."""


def draft_seconds(plan: SchedulerOutput, estimate: Estimate, cost: float, drafting: str
                  ) -> float:
    """The modelled draft model's time in this step: it fills the drafts of chunks that
    plan positions without tokens, and under `speculative_method = draft` keeps up with
    the step's other chunks (their tokens ride in its first pass). Sequential drafting
    runs one pass per draft position; parallel drafting one pass for all of them. Each
    pass costs `cost` × the target's step time over the same rows."""
    drafting_chunks = [c for c in plan.chunks if c.num_draft and not c.draft]
    for c in drafting_chunks:
        c.draft = (0,) * c.num_draft
    keep_up = [c for c in plan.chunks if not c.num_draft] \
        if plan.speculative_method == "draft" else []
    if not drafting_chunks and not keep_up:
        return 0.0
    new = sum(c.num_new_tokens for c in keep_up)
    pairs = sum(c.num_pairs for c in keep_up)
    ctx = sum(c.start + c.num_new_tokens for c in keep_up)
    if drafting == "parallel":
        n = sum(c.num_draft for c in drafting_chunks)
        return cost * estimate(new + n, pairs + sum(c.num_draft * (c.start + 1)
                                                    for c in drafting_chunks),
                               ctx + sum(c.start + c.num_draft for c in drafting_chunks))
    total = 0.0
    for j in range(1, max((c.num_draft for c in drafting_chunks), default=1) + 1):
        rows = [c for c in drafting_chunks if c.num_draft >= j]
        if j > 1 and not rows:
            break
        total += cost * estimate(new + len(rows), pairs + sum(c.start + j for c in rows),
                                 ctx + sum(c.start + j for c in rows))
        new = pairs = ctx = 0  # the kept-up chunks ride in the first pass only
    return total

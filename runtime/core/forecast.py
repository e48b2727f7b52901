"""Finish-time forecast for deadline admission: run the batch forward on the timing model.

Admission control used to price a newcomer against today's batch alone, so it ignored the
prefill work admitted in the same iteration, the slowdown the newcomer causes everyone
else, and decode steps growing as the batch fills: on the sim's reference card it admitted
12 of 40 long requests and all 12 missed their deadline. The forecast replays the
scheduler's own rules on the running batch plus the candidate, step by step, with the
executor's step-time estimate:

- each step, decoding requests get one token each, then requests still prefilling get
  chunks of at most `chunk_size` tokens from what is left of the token budget (and, under
  an ITL target, what the target allows), in admission order, at most `max_num_seqs`;
- a step takes `T(new tokens, causal pairs, context)`; a prefill that reaches its last
  token samples the first output; a request finishes with its last output token;
- while every request decodes, the steps until the next finish differ only by context
  growth, so they are priced in one go: `m` steps at the mean of the first and the last
  step's time (exact where the model is linear in context, as the fitted model is).

Arrivals that are not admitted yet are not in the forecast (each is checked when it is),
and neither are preemptions (admission under full reservation avoids them). The result is
each request's predicted finish time.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.core.step_budget import StepBudget, StepTotals
from kvdeck.runtime.core.step_data import Estimator, causal_pairs


@dataclass
class Job:
    """A request as the forecast sees it."""

    request_id: str
    computed: int
    """Tokens whose KV is computed."""
    total: int
    """Tokens known (prompt and outputs so far): the prefill runs up to here."""
    outputs_left: int
    deadline: float | None = None

    @property
    def decoding(self) -> bool:
        return self.computed == self.total - 1 and self.total > 0


def forecast(jobs: list[Job], now: float, estimate: Estimator, *, token_budget: int,
             chunk_size: int, max_num_seqs: int, itl_target_s: float = 0.0,
             block_size: int = 16, max_steps: int = 1_000_000) -> dict[str, float]:
    """Predicted finish time of each job (by request id), jobs in admission order."""
    jobs = [Job(j.request_id, j.computed, j.total, j.outputs_left, j.deadline) for j in jobs
            if j.outputs_left > 0]
    finish: dict[str, float] = {}
    t = now
    steps = 0
    while jobs and steps < max_steps:
        batch = jobs[:max_num_seqs]
        if all(j.decoding for j in batch) and len(batch) == len(jobs):
            m = min(j.outputs_left for j in batch)
            t += _decode_run(batch, m, estimate)
            steps += m
            for j in batch:
                j.computed += m
                j.total += m
                j.outputs_left -= m
        else:
            t += _mixed_step(batch, estimate, token_budget, chunk_size, itl_target_s,
                             block_size)
            steps += 1
        for j in batch:
            if j.outputs_left == 0:
                finish[j.request_id] = t
        jobs = [j for j in jobs if j.outputs_left > 0]
    return finish


def _decode_run(batch: list[Job], m: int, estimate: Estimator) -> float:
    """Seconds of `m` decode steps of the whole batch (context growing by one a step)."""
    def step(i: int) -> float:
        ctx = [j.computed + i for j in batch]
        return estimate(len(batch), sum(causal_pairs(1, c) for c in ctx),
                        sum(c + 1 for c in ctx))
    if m <= 2:
        return sum(step(i) for i in range(m))
    return m * (step(0) + step(m - 1)) / 2


def _mixed_step(batch: list[Job], estimate: Estimator, token_budget: int, chunk_size: int,
                itl_target_s: float, block_size: int) -> float:
    """One step with prefills, as the scheduler plans it; updates the jobs."""
    budget = token_budget
    planned: list[tuple[Job, int]] = []
    for j in batch:
        if j.decoding and budget > 0:
            planned.append((j, 1))
            budget -= 1
    target = StepBudget(estimate, [], itl_target_s, block_size) if itl_target_s else None
    totals = target or StepTotals(estimate, [])
    for j, n in planned:
        totals.add(j.computed, n, prefill=False)
    for j in batch:
        if j.decoding or budget <= 0:
            continue
        n = min(j.total - j.computed, chunk_size, budget)
        if target is not None:
            n = target.cap(j.computed, n)
            if n == 0:
                break
        planned.append((j, n))
        totals.add(j.computed, n)
        budget -= n
    seconds = totals.seconds()
    for j, n in planned:
        was_decoding = j.decoding
        j.computed += n
        if was_decoding or j.computed == j.total:  # sampled a token
            j.total += 1
            j.outputs_left -= 1
    return seconds

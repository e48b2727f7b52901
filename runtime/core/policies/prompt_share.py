"""How a step's prompt tokens are shared among the requests computing prompts
(`prefill_share`), once decode rows have taken theirs.

- `in_order` (vLLM's and SGLang's way, the default): running prompts, then admissions, each
  take up to `chunk_size` tokens of what budget is left, in order. The first of a burst
  has its first token soonest; the last waits for every prompt before it.
- `even`: every prompt being computed this step gets the same share of the budget (one
  that needs less than its share leaves the rest to the others), so a burst's prompts
  advance together and reach their first tokens together: a later first token for the
  first of them, an earlier one for the last, the same throughput. llama-server was
  measured to behave so (8 slots, a batch of 2,048: a burst of eight 768-token prompts got
  their first tokens within 3 ms of each other), and `benchmarks/sim_vs_real.py` predicts
  it with this policy.
"""

from __future__ import annotations


def even_share(budget: int, pending: list[int]) -> int:
    """The most tokens any one of the prompts with `pending` tokens left may take from
    `budget` shared evenly: the level `s` at which `Σ min(p, s)` fills the budget (a prompt
    needing less than `s` takes only what it needs), at least 1; `budget` itself when every
    prompt fits whole."""
    if sum(pending) <= budget:
        return budget
    left, n = budget, len(pending)
    for p in sorted(pending):
        share = left // n
        if p > share:
            return max(share, 1)
        left -= p
        n -= 1
    return budget  # not reached: the prompts did not all fit

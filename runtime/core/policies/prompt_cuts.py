"""How a step's prompt tokens are shared among the requests computing prompts
(`prefill_share`), once decode rows have taken theirs.

- `in_order` (vLLM's and SGLang's way, the default): running prompts, then admissions, each
  take up to `chunk_size` tokens of what budget is left, in order. The first of a burst
  has its first token soonest; the last waits for every prompt before it.
- `even`: every prompt being computed this step gets the same share of the budget (one
  that needs less than its share leaves the rest to the others), so a burst's prompts
  advance together and reach their first tokens together: a later first token for the
  first of them, an earlier one for the last. llama-server was
  measured to behave so (8 slots, a batch of 2,048: a burst of eight 768-token prompts got
  their first tokens within 3 ms of each other), and `benchmarks/sim_vs_real.py` predicts
  it with this policy.
"""

from __future__ import annotations

from kvdeck.runtime.core.policies.admission import lora_slot_limit
from kvdeck.runtime.core.policies.queue_order import queue_order
from kvdeck.runtime.core.request import Request, RequestStatus


def even_share(budget: int, pending: list[int]) -> int:
    """The most tokens any one of the prompts with `pending` tokens left may take from
    `budget` shared evenly: the level `s` at which `Σ min(p, s)` fills the budget, but for
    less than a token a prompt (a prompt needing less than `s` takes only what it needs), at
    least 1; `budget` itself when every prompt fits whole."""
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


def step_share(sched, prefills: list[Request], budget: int, num_scheduled: int,
               now: float, admitting: bool) -> int:
    """`budget` shared evenly among the prompts `sched` (the `Scheduler`) will compute this
    step: its running prompts, and the waiting requests admission would take now — in its
    order, skipping those it would skip (an adapter without a slot, a prompt waiting for a
    block another request is computing under `prefix_wait`) and stopping where it would (a
    request the KV pool cannot take). `admitting` is False when the step admits no one (it
    preempted a running request)."""
    k = sched.knobs
    pending = [min(r.num_pending_tokens, k.chunk_size) for r in prefills
               if r.status is RequestStatus.RUNNING]
    room = k.max_num_seqs - num_scheduled - len(pending)
    if not admitting or (k.scheduling == "static" and sched.running):
        room = 0
    full, kv = k.reservation == "full", sched.kv
    for req in queue_order(sched.waiting, k, now) if room > 0 else ():
        if lora_slot_limit(req, sched.running, sched.config.max_loras):
            continue
        if req.status is RequestStatus.SWAPPED:
            n = min(req.num_tokens - req.num_computed_tokens, k.chunk_size)
        else:
            chain = kv.prefix_chain(req)
            hit = max(len(chain) * kv.block_size, req.remote_kv_tokens)
            if k.prefix_wait and k.enable_prefix_caching and \
                    sched._prefilling_next_block(req, hit) is not None:
                continue
            n = min(req.num_tokens - hit, k.chunk_size)
            if not kv.can_admit(req, n, full, chain):
                break
        pending.append(n)
        room -= 1
        if room == 0:
            break
    return even_share(budget, pending) if pending else budget

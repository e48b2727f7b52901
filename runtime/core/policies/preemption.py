"""Who is preempted, and how.

Preemption (`recompute`): when a running request cannot get the blocks it needs, the
victim is the running request, not yet scheduled this iteration, that was admitted last
(under the `priority` policy: the lowest-priority one, latest admitted among equals) — the
request that has received the least service, as in vLLM. Its blocks are freed and it returns
to the head of the queue; its prompt and generated tokens are recomputed when it is
readmitted (reusing whatever the prefix cache still holds). If the request needing blocks is
itself the only candidate, it is the one preempted. No admissions happen in an iteration
that preempted.

Priority preemption on arrival: under the `priority` policy, when the queue's first request
cannot start (the pool cannot take its first chunk, or `max_num_seqs` requests run), running
requests of a strictly lower priority are preempted for it — lowest priority first, latest
admitted among equals — until it fits. The bound that keeps a stream of high-priority
arrivals from starving the others: a request is preempted this way at most
`ARRIVAL_PREEMPTIONS` times (after that only a pool shortage can preempt it), and a request
that has waited `priority_max_wait_s` is ordered ahead of every priority, oldest first, and
preempts nobody's way in — so every request is admitted within that wait plus the service of
the aged requests ahead of it, and once admitted loses its place at most twice to arrivals.

Preemption mode (the `preemption` knob): `recompute` as above; `swap` copies the victim's
computed blocks to the host tier instead (`kv/tiers.py`) and it resumes where it stopped
once they are copied back (`RequestStatus.SWAPPED`); `auto` decides per victim with
`swap_or_recompute`. A victim with nothing computed, or one the host tier cannot take,
recomputes.
"""

from __future__ import annotations

from collections.abc import Callable

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_data import Estimator, causal_pairs
from kvdeck.runtime.kv.manager import BlockManager

ARRIVAL_PREEMPTIONS = 2
"""The most times one request is preempted for a higher-priority arrival."""


def swap_or_recompute(num_tokens: int, block_size: int, bytes_per_block: int,
                      link_seconds: Callable[[int], float], estimate: Estimator
                      ) -> tuple[str, float, float]:
    """`auto` preemption's rule for a victim with `num_tokens` computed tokens: swap when
    copying its blocks out and back, `2 · bytes / link bandwidth`, takes less than
    recomputing them — the time its tokens add to a step, `estimate(L, pairs, L) −
    estimate(0, 0, 0)` (a recompute rides in steps that run anyway, so their fixed cost is
    not its own). Returns (choice, swap seconds, recompute seconds).

    Blocks are copied whole, so a victim with a few tokens pays a whole block each way; on
    a roofline step model a short recompute is nearly free (it fills a memory-bound step's
    idle compute), a long one is not (its cost grows with tokens and causal pairs)."""
    nbytes = -(-num_tokens // block_size) * bytes_per_block
    swap = 2.0 * link_seconds(nbytes)
    recompute = estimate(num_tokens, causal_pairs(num_tokens, 0), num_tokens) \
        - estimate(0, 0, 0)
    return ("swap" if swap < recompute else "recompute"), swap, recompute


def pick_victim(running: list[Request], scheduled: set[str], queue_policy: str) -> Request:
    """The request preempted when the pool runs short: the latest admitted one not yet
    scheduled this step (under `priority`: the lowest priority, latest among equals)."""
    # `running` is in admission order, so a larger index means admitted later.
    candidates = [(i, r) for i, r in enumerate(running) if r.request_id not in scheduled]
    if queue_policy == "priority":
        return max(candidates, key=lambda ir: (ir[1].priority, ir[0]))[1]
    return candidates[-1][1]


def arrival_victim(running: list[Request], head: Request) -> Request | None:
    """The running request to preempt for the higher-priority `head`, or None: the lowest
    priority strictly below head's, latest admitted among equals, preempted for arrivals
    fewer than `ARRIVAL_PREEMPTIONS` times."""
    victims = [(i, r) for i, r in enumerate(running)
               if r.priority > head.priority and r.num_arrival_preemptions < ARRIVAL_PREEMPTIONS]
    if not victims:
        return None
    return max(victims, key=lambda ir: (ir[1].priority, ir[0]))[1]


def preemption_mode(req: Request, mode: str, kv: BlockManager, estimate: Estimator) -> str:
    """How `req` would be preempted now under the `preemption` knob `mode`: `swap` or
    `recompute`."""
    if mode == "recompute" or not kv.swaps.can_swap_out(kv.blocks_needed(req.num_computed_tokens)):
        return "recompute"
    if mode == "swap":
        return "swap"
    return swap_or_recompute(req.num_computed_tokens, kv.block_size, kv.bytes_per_block,
                             kv.link_seconds, estimate)[0]

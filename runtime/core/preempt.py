"""Preempting running requests: taking one out of the batch to the head of the queue, its
blocks freed (it recomputes) or swapped out to the host tier (it resumes). A plan preempts
to make room for a chunk (`make_room`) or, under `priority`, for the queue's first request
(`preempt_for_arrival`); between steps the engine's switches preempt until the running
requests fit a smaller pool (`preempt_to_fit`) and send swapped-out requests back to
recompute when the host tier goes (`unswap_all`).

Who the victim is and whether it swaps are policies (`policies/preemption.py`); these
functions carry them out on the scheduler's queues and counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdeck.runtime.core.policies.admission import never_fits
from kvdeck.runtime.core.policies.preemption import arrival_victim, pick_victim
from kvdeck.runtime.core.policies.queue_order import priority_key
from kvdeck.runtime.core.request import Request, RequestStatus
from kvdeck.runtime.core.step_data import SchedulerOutput

if TYPE_CHECKING:  # the scheduler calls these: a type only, no import cycle
    from kvdeck.runtime.core.scheduler import Scheduler


def make_room(sched: Scheduler, req: Request, n: int, scheduled: set[str],
              plan: SchedulerOutput) -> list[tuple[int, int]] | None:
    """Grow `req` by `n` tokens, preempting others as needed; returns the copy-on-write
    pairs, or None if `req` itself had to be preempted."""
    while True:
        cows = sched.kv.try_allocate(req, n)
        if cows is not None:
            return cows
        victim = pick_victim(sched.running, scheduled, sched.knobs.queue_policy)
        _preempt(sched, victim, plan)
        if victim is req:
            return None


def preempt_for_arrival(sched: Scheduler, plan: SchedulerOutput, now: float) -> None:
    """Under `priority`: preempt lower-priority running requests until the queue's first
    request can start (`policies/preemption.py` says how this is bounded)."""
    k = sched.knobs
    kv = sched.kv
    head = min(sched.waiting, key=priority_key(k, now))  # the queue's first, no sort
    if head.status is not RequestStatus.WAITING or \
            now - head.arrival_time >= k.priority_max_wait_s:
        return  # resumed requests and aged ones take their turn without preempting
    full = k.reservation == "full"
    if never_fits(head, full, kv, k.chunk_size):
        return
    while True:
        chain = kv.prefix_chain(head)  # preempted blocks may have been cached ones
        n = min(head.num_tokens - len(chain) * kv.block_size, k.chunk_size,
                k.max_num_batched_tokens)
        if len(sched.running) < k.max_num_seqs and kv.can_admit(head, n, full, chain):
            return
        victim = arrival_victim(sched.running, head)
        if victim is None:
            return
        victim.num_arrival_preemptions += 1
        swap = sched.preemption_mode(victim) == "swap"
        preempt_now(sched, victim, now, f"for higher-priority {head.request_id} "
                                        f"(priority {head.priority} < {victim.priority})"
                    + ("" if swap else "; blocks freed, to be recomputed"), swap)
        if swap:
            plan.swapped.append(victim.request_id)
        plan.preempted.append(victim.request_id)


def _preempt(sched: Scheduler, req: Request, plan: SchedulerOutput) -> None:
    swap = sched.preemption_mode(req) == "swap"
    preempt_now(sched, req, plan.time, swap=swap)
    if swap:
        plan.swapped.append(req.request_id)
    plan.preempted.append(req.request_id)


def preempt_now(sched: Scheduler, req: Request, now: float,
                why: str = "blocks freed, to be recomputed", swap: bool = False) -> None:
    """Take `req` out of the batch to the head of the queue: its blocks freed (it
    recomputes), or with `swap` its computed blocks copied to the host tier first (it
    resumes where it stopped)."""
    sched.running.remove(req)
    if swap:
        n = sched.kv.swaps.swap_out(req)
        req.status = RequestStatus.SWAPPED
        why = f"{n:,} blocks swapped out to the host"
        sched.num_swapped += 1
    else:
        sched.kv.release(req)
        req.status = RequestStatus.PREEMPTED
        _dropped(sched, req)
    req.num_preemptions += 1
    req.events.append((now, f"preempted: {why}"))
    sched.num_preemptions += 1
    sched.waiting.appendleft(req)


def unswap_all(sched: Scheduler, now: float, why: str) -> list[str]:
    """Swapped-out requests lose their host copies and will recompute (the host tier
    is being dropped). Returns their ids."""
    out = []
    for req in sched.waiting:
        if req.status is RequestStatus.SWAPPED:
            sched.kv.swaps.unswap(req)
            req.status = RequestStatus.PREEMPTED
            _dropped(sched, req)
            req.events.append((now, f"host copy dropped ({why}): to be recomputed"))
            out.append(req.request_id)
    return out


def _dropped(sched: Scheduler, req: Request) -> None:
    """`req`'s KV is gone: note how far it had got (recomputing that much is waste), then
    start it over."""
    had = sched.dropped.get(req.request_id, 0)
    sched.dropped[req.request_id] = max(had, req.num_computed_tokens)
    req.num_computed_tokens = 0


def preempt_to_fit(sched: Scheduler, num_blocks: int, now: float, why: str) -> list[str]:
    """Between steps: preempt running requests (the scheduler's usual victims, latest
    admitted first) until the blocks they hold plus reservations fit in `num_blocks`.
    Returns the ids preempted, in order."""
    out: list[str] = []
    kv = sched.kv
    while sched.running and kv.pool.num_held + kv.num_reserved > num_blocks:
        victim = pick_victim(sched.running, set(), sched.knobs.queue_policy)
        preempt_now(sched, victim, now, why)
        out.append(victim.request_id)
    return out

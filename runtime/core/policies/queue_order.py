"""The order waiting requests are admitted in (the `queue_policy` knob): `fcfs`, `priority`
(with aging), `edf` (earliest deadline first) and `sjf` (shortest prompt first, with aging).
Preempted and swapped-out requests go back to the head of the queue."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.request import Request, RequestStatus

RESUMED = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


def priority_key(knobs: Knobs, now: float) -> Callable[[Request], tuple]:
    """Queue order under `priority`: requests that waited `priority_max_wait_s` first,
    oldest first; then by priority, resumed ones ahead of fresh ones of the same
    priority, then by arrival."""
    limit = knobs.priority_max_wait_s
    return lambda r: ((0, r.arrival_time, 0, 0) if now - r.arrival_time >= limit else
                      (1, r.priority, 0 if r.status in RESUMED else 1, r.arrival_time))


def queue_order(waiting: deque[Request], knobs: Knobs, now: float) -> list[Request]:
    """The waiting requests in the order admission tries them."""
    policy = knobs.queue_policy
    if policy == "fcfs":
        # Preempted requests were put at the head. Only the front of a long queue can be
        # admitted this iteration, so copy no more than that.
        return list(itertools.islice(waiting, knobs.max_num_seqs + 256))
    if policy == "priority":
        return sorted(waiting, key=priority_key(knobs, now))
    resumed = [r for r in waiting if r.status in RESUMED]
    fresh = [r for r in waiting if r.status not in RESUMED]
    if policy == "edf":
        fresh.sort(key=lambda r: (r.deadline if r.deadline is not None else math.inf,
                                  r.arrival_time))
    else:  # sjf with aging: requests past the wait limit go first, oldest first
        limit = knobs.sjf_max_wait_s
        fresh.sort(key=lambda r: (0, r.arrival_time, 0) if now - r.arrival_time >= limit
                   else (1, r.num_prompt_tokens, r.arrival_time))
    return resumed + fresh

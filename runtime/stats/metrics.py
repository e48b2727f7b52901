"""Per-request and per-run figures (docs/architecture.md, "Request timing" and "Throughput
vs goodput").

    TTFT  = t_first − t_arrival          ITL_j = t_{j+1} − t_j
    E2E   = TTFT + Σ ITL                 TPOT  = (E2E − TTFT) / (G − 1)

Times count from the request's scheduled arrival, so queueing outside the engine counts.
Goodput counts only requests that finished, passed their answer check if they carried one
(`runtime/text/checks.py`) and met every SLO and their deadline, per second of observed time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from kvdeck.runtime.core.config import check_float
from kvdeck.runtime.core.request import Request, RequestStatus


@dataclass(frozen=True)
class RequestMetrics:
    """Timing of one request (None where it does not apply, e.g. no token was produced)."""

    request_id: str
    status: str
    reason: str | None
    arrival: float
    admitted: float | None
    first_token: float | None
    finish: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    num_preemptions: int
    ttft: float | None
    tpot: float | None
    e2e: float | None
    queue_time: float | None
    itls: tuple[float, ...]
    deadline: float | None
    met_deadline: bool | None
    predicted_finish: float | None = None
    """Admission control's forecast of `finish`, made at admission."""
    correct: bool | None = None
    """Whether the answer passed its check; None: no check, or no answer to check."""

    def to_dict(self) -> dict:
        # Fields are immutable values (`itls` a tuple), so a shallow copy is `asdict`'s
        # result without its per-element deep copy (a fleet's summary of ~1,000 requests of
        # ~1,000 tokens each spent seconds there).
        return {f.name: getattr(self, f.name) for f in fields(self)}


def request_metrics(req: Request) -> RequestMetrics:
    times = req.token_times
    itls = tuple(b - a for a, b in zip(times, times[1:], strict=False))
    ttft = req.first_token_time - req.arrival_time if req.first_token_time is not None else None
    finished = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
    e2e = req.finish_time - req.arrival_time if finished and req.finish_time is not None \
        else None
    g = len(times)
    tpot = (e2e - ttft) / (g - 1) if e2e is not None and ttft is not None and g > 1 else None
    met = None
    if req.deadline is not None:
        met = finished and req.finish_time is not None and req.finish_time <= req.deadline
    return RequestMetrics(
        request_id=req.request_id, status=req.status.value, reason=req.reason,
        arrival=req.arrival_time, admitted=req.admitted_time,
        first_token=req.first_token_time, finish=req.finish_time,
        prompt_tokens=req.num_prompt_tokens, output_tokens=req.num_output_tokens,
        cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
        ttft=ttft, tpot=tpot, e2e=e2e,
        queue_time=req.admitted_time - req.arrival_time if req.admitted_time is not None
        else None,
        itls=itls, deadline=req.deadline, met_deadline=met,
        predicted_finish=req.predicted_finish, correct=req.correct,
    )


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles (linear interpolation between order statistics)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        xs = sorted(values)
        if not xs:
            return cls(0, None, None, None, None)
        return cls(len(xs), math.fsum(xs) / len(xs), percentile(xs, 50), percentile(xs, 90),
                   percentile(xs, 99))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile of already-sorted values, as numpy's default 'linear' method."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput; None disables a bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    require_deadline: bool = True
    """Requests with a deadline must meet it to count."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None:
                check_float(name, v, 0.0, 1e9)

    def met(self, m: RequestMetrics) -> bool:
        """Finished within every bound (correctness is `good`'s business)."""
        if m.status not in ("finished_stopped", "finished_length"):
            return False
        if self.ttft_s is not None and (m.ttft is None or m.ttft > self.ttft_s):
            return False
        if self.tpot_s is not None and m.tpot is not None and m.tpot > self.tpot_s:
            return False
        if self.e2e_s is not None and (m.e2e is None or m.e2e > self.e2e_s):
            return False
        return not (self.require_deadline and m.met_deadline is False)


def good(m: RequestMetrics, slo: SLO) -> bool:
    """Counts towards goodput: finished within the SLOs, and correct if it was checked."""
    return slo.met(m) and m.correct is not False

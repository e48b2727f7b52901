"""Per-request and per-run figures (DESIGN.md, "Request timing" and "Throughput vs goodput").

    TTFT  = t_first − t_arrival          ITL_j = t_{j+1} − t_j
    E2E   = TTFT + Σ ITL                 TPOT  = (E2E − TTFT) / (G − 1)

Times count from the request's scheduled arrival, so queueing outside the engine counts.
Goodput counts only requests that finished, were correct (a hook) and met every SLO and
their deadline, per second of observed time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from runtime.config import check_float
from runtime.request import Request, RequestStatus


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

    def to_dict(self) -> dict:
        return asdict(self)


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
        if m.status not in ("finished_stopped", "finished_length"):
            return False
        if self.ttft_s is not None and (m.ttft is None or m.ttft > self.ttft_s):
            return False
        if self.tpot_s is not None and m.tpot is not None and m.tpot > self.tpot_s:
            return False
        if self.e2e_s is not None and (m.e2e is None or m.e2e > self.e2e_s):
            return False
        return not (self.require_deadline and m.met_deadline is False)


@dataclass
class RunStats:
    """Per-step figures the engine accumulates while it runs."""

    num_steps: int = 0
    busy_seconds: float = 0.0
    """Sum of step times: accelerator-busy time."""
    resident_seconds: float = 0.0
    """∫ (waiting + running requests) dt over the run, for the Little's-law check."""
    # Running sums, not per-step lists: a server steps for days.
    sum_batch_size: int = 0
    sum_batch_tokens: int = 0
    last_step_seconds: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def on_step(self, batch_size: int, tokens: int, prefill: int, decode: int,
                seconds: float) -> None:
        self.num_steps += 1
        self.busy_seconds += seconds
        self.sum_batch_size += batch_size
        self.sum_batch_tokens += tokens
        self.last_step_seconds = seconds
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += decode

    def on_interval(self, resident: int, seconds: float) -> None:
        self.resident_seconds += resident * seconds


def summarize(ms: Sequence[RequestMetrics], stats: RunStats, slo: SLO = SLO(),
              correct: Callable[[str], bool] | None = None) -> dict:
    """A run's figures as plain data: counts, latency distributions, throughput, goodput,
    Little's law, per-step figures and accelerator-seconds per good result.

    `correct(request_id)` is the per-request correctness flag; None counts all as correct.
    """
    start = min((m.arrival for m in ms), default=0.0)
    end = max((m.finish for m in ms if m.finish is not None), default=start)
    span = max(end - start, 1e-12)
    finished = [m for m in ms if m.status in ("finished_stopped", "finished_length")]
    good = [m for m in finished
            if slo.met(m) and (correct is None or correct(m.request_id))]
    residence = [m.finish - m.arrival for m in ms if m.finish is not None]
    arrival_rate = len(residence) / span
    steps = stats.num_steps
    statuses: dict[str, int] = {}
    for m in ms:
        statuses[m.status] = statuses.get(m.status, 0) + 1
    return {
        "num_requests": len(ms),
        "statuses": statuses,
        "makespan_s": span if ms else 0.0,
        "completion_throughput_rps": len(finished) / span,
        "goodput_rps": len(good) / span,
        "num_good": len(good),
        "output_tokens_per_s": sum(m.output_tokens for m in finished) / span,
        "prompt_tokens": sum(m.prompt_tokens for m in ms),
        "cached_prompt_tokens": sum(m.cached_tokens for m in ms),
        "num_preemptions": sum(m.num_preemptions for m in ms),
        "ttft_s": asdict(Distribution.of(m.ttft for m in ms if m.ttft is not None)),
        "tpot_s": asdict(Distribution.of(m.tpot for m in ms if m.tpot is not None)),
        "itl_s": asdict(Distribution.of(x for m in ms for x in m.itls)),
        "e2e_s": asdict(Distribution.of(m.e2e for m in ms if m.e2e is not None)),
        "queue_s": asdict(Distribution.of(m.queue_time for m in ms
                                          if m.queue_time is not None)),
        "littles_law": {
            "measured_mean_resident": stats.resident_seconds / span,
            "arrival_rate_rps": arrival_rate,
            "mean_residence_s": math.fsum(residence) / len(residence) if residence else 0.0,
            "predicted_mean_resident": arrival_rate * (math.fsum(residence) / len(residence))
            if residence else 0.0,
        },
        "steps": {
            "count": steps,
            "busy_s": stats.busy_seconds,
            "mean_batch_size": stats.sum_batch_size / steps if steps else 0.0,
            "mean_batch_tokens": stats.sum_batch_tokens / steps if steps else 0.0,
            "mean_step_s": stats.busy_seconds / steps if steps else 0.0,
            "prefill_tokens": stats.num_prefill_tokens,
            "decode_tokens": stats.num_decode_tokens,
        },
        "accelerator_s_per_good_result": stats.busy_seconds / len(good) if good else None,
        "slo": asdict(slo),
    }

"""`kvdeck sweep`: one workload at increasing arrival rates, to find where goodput stops
growing with load (the knee) and the admission cap that holds it past the knee.

Each rate replays the same arrivals with their times scaled (a trace keeps its shape: bursts
and lulls stay bursts and lulls) through a fresh engine, or against a server. Per rate it
reports completion throughput and goodput under the SLOs (docs/architecture.md, "Throughput
vs goodput"). Past the knee the queue grows faster than it drains, so every request waits
longer and misses its SLO together: goodput falls although completions do not.

The cap is a bound on the requests in the engine (`max_waiting`: waiting and running
together). By Little's law the engine holds `n̄ = λ·T̄` requests on average; at the knee that
`n̄` is what the card serves within the SLOs, so capping the engine at it — rejecting the
rest at once, with a sentence, instead of letting them queue — keeps admitted requests
within their SLOs past the knee. The sweep re-runs the rates past the knee with that cap to
show it holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvdeck.runtime.runs.trace import Arrival

DEFAULT_SCALES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.6, 1.0)
"""Multiples of a trace's own arrival rate swept when no rates are given."""


def offered_rate(arrivals: Sequence[Arrival]) -> float:
    """Requests per second the arrivals offer: `(n − 1) / (last − first)`."""
    if len(arrivals) < 2:
        return 0.0
    span = arrivals[-1].arrival_s - arrivals[0].arrival_s
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def at_rate(arrivals: Sequence[Arrival], rate: float) -> list[Arrival]:
    """The arrivals with their gaps scaled so that they offer `rate` requests per second."""
    base = offered_rate(arrivals)
    if not math.isfinite(base) or base <= 0:
        return list(arrivals)
    scale = base / rate
    t0 = arrivals[0].arrival_s
    return [dataclasses.replace(a, arrival_s=t0 + (a.arrival_s - t0) * scale) for a in arrivals]


@dataclass(frozen=True)
class SweepPoint:
    """One rate's run."""

    rate_rps: float
    """Offered arrival rate."""
    completion_rps: float
    goodput_rps: float
    num_requests: int
    num_good: int
    num_rejected: int
    mean_resident: float
    """Requests in the engine on average (measured; Little's law `λ·T̄` against a server)."""
    ttft_p99_s: float | None
    cap: int | None = None
    """The engine's request cap for this run (None: the settings' own)."""

    @classmethod
    def of(cls, rate: float, summary: dict, cap: int | None = None) -> SweepPoint:
        little = summary["littles_law"]
        resident = little["measured_mean_resident"]
        if resident is None:
            resident = little["predicted_mean_resident"]
        ttft = summary["ttft_s"]
        return cls(rate, summary["completion_throughput_rps"], summary["goodput_rps"],
                   summary["num_requests"], summary["num_good"],
                   summary["statuses"].get("rejected", 0), resident,
                   ttft.get("p99") if ttft.get("count") else None, cap)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SweepResult:
    points: list[SweepPoint]
    knee: int
    """Index of the point where goodput peaks."""
    cap: int
    """The recommended bound on requests in the engine (`--max-waiting`)."""
    capped: list[SweepPoint] = field(default_factory=list)
    """The rates past the knee again, with the cap (empty when not checked)."""

    @property
    def knee_point(self) -> SweepPoint:
        return self.points[self.knee]

    def holds(self, fraction: float = 0.9) -> bool:
        """Goodput with the cap stays at or above `fraction` of the knee's at every rate
        past it (never, when nothing was good at the knee)."""
        peak = self.knee_point.goodput_rps
        if peak == 0:
            return False
        return all(p.goodput_rps >= fraction * peak for p in self.capped)

    def to_json(self) -> dict:
        return {"points": [p.to_json() for p in self.points], "knee": self.knee_point.to_json(),
                "knee_inside": 0 < self.knee < len(self.points) - 1,
                "recommended_max_waiting": self.cap,
                "capped": [p.to_json() for p in self.capped],
                "cap_holds_goodput": self.holds() if self.capped else None}


def knee_index(points: Sequence[SweepPoint]) -> int:
    """The point of peak goodput (the lowest rate among equal peaks)."""
    best = max(p.goodput_rps for p in points)
    return next(i for i, p in enumerate(points) if p.goodput_rps >= best)


def recommended_cap(knee: SweepPoint) -> int:
    """Requests in the engine at the knee, `ceil(n̄)` (at least 1)."""
    return max(1, math.ceil(knee.mean_resident))


Runner = Callable[[list[Arrival], int | None], dict]
"""(arrivals, cap on requests in the engine or None) → the run's summary."""


def sweep(run: Runner, arrivals: Sequence[Arrival], rates: Sequence[float],
          check_cap: bool = True, progress: Callable[[str], None] = lambda _: None
          ) -> SweepResult:
    """Run `arrivals` at each rate (ascending), find the knee, and with `check_cap` run the
    rates past it again with the recommended cap."""
    points = []
    for rate in sorted(rates):
        points.append(SweepPoint.of(rate, run(at_rate(arrivals, rate), None)))
        p = points[-1]
        progress(f"{rate:.3g} rps: completion {p.completion_rps:.3f}, goodput "
                 f"{p.goodput_rps:.3f}")
    knee = knee_index(points)
    cap = recommended_cap(points[knee])
    result = SweepResult(points, knee, cap)
    if check_cap:
        for p in points[knee + 1:]:
            result.capped.append(SweepPoint.of(p.rate_rps, run(at_rate(arrivals, p.rate_rps),
                                                               cap), cap))
            c = result.capped[-1]
            progress(f"{p.rate_rps:.3g} rps, at most {cap} in the engine: goodput "
                     f"{c.goodput_rps:.3f}")
    return result

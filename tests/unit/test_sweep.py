"""The sweep's pieces on hand-made data: scaling arrivals to a rate keeps their shape, the
knee is the peak of goodput, and the cap is the engine's mean occupancy there, rounded up."""

from __future__ import annotations

import pytest

from kvdeck.runtime.planning.sweep import (
    SweepPoint,
    at_rate,
    knee_index,
    offered_rate,
    recommended_cap,
)
from kvdeck.runtime.runs.trace import Arrival


def test_scaling_to_a_rate_keeps_the_shape_of_the_trace() -> None:
    arrivals = [Arrival(t, 10, 5) for t in (2.0, 2.0, 3.0, 6.0)]  # a burst, then a lull
    assert offered_rate(arrivals) == pytest.approx(3 / 4)
    fast = at_rate(arrivals, 3.0)
    assert [a.arrival_s for a in fast] == pytest.approx([2.0, 2.0, 2.25, 3.0])
    assert offered_rate(fast) == pytest.approx(3.0)
    assert [a.prompt_len for a in fast] == [10] * 4


def point(rate: float, goodput: float, resident: float) -> SweepPoint:
    return SweepPoint(rate, goodput * 1.2, goodput, 100, int(goodput * 100), 0, resident, 1.0)


def test_the_knee_is_peak_goodput_and_the_cap_its_occupancy() -> None:
    points = [point(1, 0.9, 2.0), point(2, 1.7, 4.2), point(3, 1.7, 7.5), point(4, 0.4, 30)]
    assert knee_index(points) == 1  # the lower of two equal peaks
    assert recommended_cap(points[1]) == 5
    assert recommended_cap(point(1, 0.1, 0.2)) == 1

"""Engine clocks: measured wall time, modelled virtual time, and virtual time paced to the
wall clock.

- `WallClock` (real executors): seconds since the engine started; steps take the time
  they take.
- `VirtualClock` (the sim executor, headless): advances only by modelled step durations and
  jumps to the next arrival when idle, so a trace of an hour runs in seconds.
- `PacedClock` (the sim executor behind the console or the API server): virtual time that
  keeps `pace` virtual seconds per wall second. A step of modelled duration `dt` takes
  `dt / pace` wall seconds (the engine sleeps out the difference), so a client of
  `kvdeck serve --executor sim` sees the simulated card's timing. When the engine has
  nothing to do the clock *floats* with the wall clock, so a request that arrives from
  another thread is stamped with its true arrival time. When the engine cannot keep up
  (its own CPU cost exceeds the modelled step), virtual time falls behind the wall; `lag_s`
  says by how much.

Every clock offers the same calls, so the engine does not branch on which one it has.
"""

from __future__ import annotations

import threading
import time


class WallClock:
    """Measured time in seconds since the engine started."""

    jumps = False
    """Whether an idle engine may jump the clock to its next arrival."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def arrival_time(self) -> float:
        """The time to stamp on a request that arrives now from any thread."""
        return self.now()

    def advance(self, seconds: float) -> None:
        """Wall time advances by itself."""

    def advance_to(self, t: float) -> None:
        """Wall time cannot jump; the loop waits instead."""

    def float(self) -> None:
        """Wall time always follows the wall."""

    def pin(self) -> None:
        """Wall time always follows the wall."""

    def freeze(self) -> None:
        """Paused time is real time for a real executor: nothing to do."""

    def resume(self) -> None:
        """See `freeze`."""

    def wait_until_due(self, stop: threading.Event) -> None:
        """A measured step already took its time."""

    def seconds_until(self, t: float) -> float:
        """Wall seconds until engine time `t`."""
        return max(t - self.now(), 0.0)

    @property
    def lag_s(self) -> float:
        return 0.0


class VirtualClock(WallClock):
    """Modelled time: advances only by step durations and jumps to the next arrival."""

    jumps = True

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)

    def seconds_until(self, t: float) -> float:
        return 0.0  # virtual time never waits for the wall


class PacedClock(VirtualClock):
    """Virtual time held to `pace` virtual seconds per wall second."""

    jumps = False

    def __init__(self, pace: float = 1.0) -> None:
        super().__init__()
        if not pace > 0:
            raise ValueError("pace must be greater than 0")
        self.pace = pace
        self._origin_wall = time.monotonic()
        self._origin_virtual = 0.0
        self._floating = True
        self._frozen = False

    def _target(self) -> float:
        """The virtual time the wall clock says it is."""
        if self._frozen:
            return self.t
        return self._origin_virtual + (time.monotonic() - self._origin_wall) * self.pace

    def _rebase(self) -> None:
        self._origin_wall, self._origin_virtual = time.monotonic(), self.t

    def now(self) -> float:
        """The engine's time: the wall's while idle (floating), else the modelled time."""
        return self._target() if self._floating else self.t

    def arrival_time(self) -> float:
        # While the engine sleeps out a step its time runs ahead of the wall: a request
        # that arrives then is stamped with the (earlier) wall time it really came at.
        return min(self.now(), self._target())

    def float(self) -> None:
        """The engine is idle: follow the wall clock."""
        self._floating = True

    def pin(self) -> None:
        """The engine starts a step: from here on time moves only by modelled durations."""
        if self._floating:
            self.t = max(self.t, self._target())
            self._floating = False

    def freeze(self) -> None:
        """Pause: virtual time stops, and paused wall time never counts as latency."""
        self.pin()
        self._frozen = True

    def resume(self) -> None:
        self._frozen = False
        self._rebase()

    def wait_until_due(self, stop: threading.Event) -> None:
        """Sleep until the wall clock reaches the engine's time (a step of modelled duration
        `dt` then takes `dt / pace` wall seconds); returns early when `stop` is set."""
        while not stop.is_set():
            ahead = (self.t - self._target()) / self.pace
            if ahead <= 0:
                return
            stop.wait(min(ahead, 0.25))

    def seconds_until(self, t: float) -> float:
        return max((t - self._target()) / self.pace, 0.0)

    @property
    def lag_s(self) -> float:
        """Virtual seconds the engine is behind its pace (0 when keeping up or idle)."""
        if self._floating or self._frozen:
            return 0.0
        return max(self._target() - self.t, 0.0)

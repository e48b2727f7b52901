"""`EngineLoop`: runs an engine in its own thread.

The loop steps while there is work and sleeps on the engine's wake event when idle, so
submissions from other threads (the console, HTTP handlers) are picked up at once. On a
virtual clock it can be paced — `pace` virtual seconds per wall second — so a simulated
datacenter run unfolds at a watchable speed; unpaced, it runs as fast as it can. Snapshots
go to `on_snapshot` at most every `snapshot_interval_s` of wall time (and once more when the
engine goes idle); the callback must not block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from runtime.engine import Engine
from runtime.snapshot import EngineSnapshot


class EngineLoop:
    """A thread that owns `engine.step()`; pause, resume and step-once are thread-safe."""

    def __init__(self, engine: Engine, *, on_snapshot: Callable[[EngineSnapshot], None]
                 | None = None, snapshot_interval_s: float = 0.1, pace: float | None = None,
                 before_step: Callable[[Engine], None] | None = None):
        self.engine = engine
        self.before_step = before_step
        """Called on the engine thread before every iteration (e.g. a traffic generator)."""
        self.on_snapshot = on_snapshot
        self.snapshot_interval_s = snapshot_interval_s
        self.pace = pace
        self.error: BaseException | None = None
        """Set if the loop died on an unexpected exception (the engine is then unusable)."""
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._step_once = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdeck-engine", daemon=True)
        self._last_publish = 0.0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the current iteration and wait for the thread to end."""
        self._stop.set()
        self.engine.wake.set()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self.engine.wake.set()

    def step_once(self) -> None:
        """While paused, run exactly one iteration."""
        self._step_once.set()
        self.engine.wake.set()

    def _publish(self, force: bool = False) -> None:
        if self.on_snapshot is None:
            return
        now = time.monotonic()
        if force or now - self._last_publish >= self.snapshot_interval_s:
            self._last_publish = now
            self.on_snapshot(self.engine.snapshot())

    def _run(self) -> None:
        engine = self.engine
        wall0, virt0 = time.monotonic(), engine.clock.now()
        try:
            while not self._stop.is_set():
                if self._paused.is_set() and not self._step_once.is_set():
                    engine.wake.wait(0.05)
                    engine.wake.clear()
                    wall0, virt0 = time.monotonic(), engine.clock.now()
                    continue
                self._step_once.clear()
                if self.before_step is not None:
                    self.before_step(engine)
                record = engine.step()
                if record is None:
                    self._publish(force=True)
                    engine.wake.wait(0.05)
                    engine.wake.clear()
                    wall0, virt0 = time.monotonic(), engine.clock.now()
                    continue
                self._publish()
                if self.pace and engine.executor.virtual_time:
                    ahead = (engine.clock.now() - virt0) / self.pace - (time.monotonic() - wall0)
                    if ahead > 0:
                        self._stop.wait(min(ahead, 0.5))
        except BaseException as e:  # noqa: BLE001 - recorded for the owner to report
            self.error = e

"""`EngineLoop`: runs an engine in its own thread and publishes its snapshots.

The loop steps while there is work and sleeps on the engine's wake event when idle, so
submissions from other threads (the console, HTTP handlers) are picked up at once. Pause,
resume and single steps are inbox messages like every other command (`pause()` and friends
only post them), so nothing but this thread ever steps the engine.

Snapshots go to every subscriber at most every `snapshot_interval_s` of wall time, once
when the engine goes idle and about once a second while it stays idle; subscribers must not
block. If a step raises, the loop stops the engine for good (`Engine.fail`: requests
aborted, traceback in a log file), publishes the snapshot that says so, and ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvdeck.runtime.core.commands import Pause, Resume, StepOnce
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.views.snapshot import EngineSnapshot, snapshot_builder

IDLE_PUBLISH_S = 1.0


class SharedBusy:
    """Wall seconds during which at least one of several engines was stepping: the busy
    time of the one device engines in one process share (two models served side by side on
    one CPU or GPU). Summing each engine's own busy time would count twice the seconds in
    which both stepped, each slowed by the other."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self.clock()
            self._active += 1

    def end(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += self.clock() - self._since

    @property
    def seconds(self) -> float:
        with self._lock:
            ongoing = self.clock() - self._since if self._active else 0.0
            return self._total + ongoing


class EngineLoop:
    """A thread that owns `engine.step()`."""

    def __init__(self, engine: Engine, *, on_snapshot: Callable[[EngineSnapshot], None]
                 | None = None, snapshot_interval_s: float = 0.1,
                 before_step: Callable[[Engine], None] | None = None):
        self.engine = engine
        self.snapshots = snapshot_builder(engine)
        self.before_step = before_step
        """Called on the engine thread before every iteration (e.g. a traffic generator)."""
        self.subscribers: list[Callable[[EngineSnapshot], None]] = []
        if on_snapshot is not None:
            self.subscribers.append(on_snapshot)
        self.snapshot_interval_s = snapshot_interval_s
        self.latest: EngineSnapshot | None = None
        """The last published snapshot."""
        self.busy: SharedBusy | None = None
        """Told of every step taken with work to do, when engines share a device."""
        self.error: BaseException | None = None
        """The exception that stopped the engine, if one did."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdeck-engine", daemon=True)
        self._last_publish = 0.0
        self._published_changes = -1

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 300.0) -> bool:
        """Stop after the current iteration and wait for the thread; True when it ended.

        The wait is long on purpose: a step of a real model on a loaded CPU can take many
        seconds, and the executor's native resources must not be released under it (a
        native abort). Returns False only if the thread is truly stuck."""
        self._stop.set()
        self.engine.stop_event.set()
        self.engine.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self.engine.paused

    def pause(self) -> None:
        self.engine.post(Pause())

    def resume(self) -> None:
        self.engine.post(Resume())

    def step_once(self, count: int = 1) -> None:
        """While paused, run `count` iterations."""
        self.engine.post(StepOnce(count))

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_publish < self.snapshot_interval_s:
            return
        self._last_publish = now
        self._published_changes = self.engine.num_changes
        snap = self.snapshots.build()
        self.latest = snap
        for callback in self.subscribers:
            callback(snap)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                if self.before_step is not None:
                    self.before_step(engine)
                if self.busy is not None and engine.has_work:
                    self.busy.begin()
                    try:
                        stepped = engine.step() is not None
                    finally:
                        self.busy.end()
                else:
                    stepped = engine.step() is not None
                if stepped:
                    self._publish()
                    continue
                # Idle: publish what changed (a pause, an abort), else about once a second.
                if engine.num_changes != self._published_changes or \
                        time.monotonic() - self._last_publish >= IDLE_PUBLISH_S:
                    self._publish(force=True)
                wait = engine.next_arrival_in()
                engine.wake.wait(0.05 if wait is None else min(max(wait, 0.0), 0.05))
                engine.wake.clear()
        except BaseException as e:  # noqa: BLE001 - the engine reports it; the thread ends
            self.error = e
            engine.fail(e)
            self._publish(force=True)

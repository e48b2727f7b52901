"""A simulated fleet run live, for the console's fleet screen (`kvdeck console --executor
sim --replicas N`): the one-clock loop (`replicas.Cluster`) on its own thread, held to the
wall clock at `pace` virtual seconds per wall second, read the way the fleet screen reads
real servers.

Each replica's row comes from its `/metrics` text — rendered from its snapshots by the
server's own collector (`server/metrics.py`) and parsed by attach's reader — and its
prefix tree from its KV events, packed as vLLM sends them and decoded into a
`ReplicaCache`. So the screen shows a simulated fleet through the same figures as a real one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from collections.abc import Sequence

import msgpack

from kvdeck.runtime.cluster.replicas import Cluster, Replica
from kvdeck.runtime.fleet.fleet import ReplicaRow, delta
from kvdeck.runtime.fleet.fleet_tree import FleetNode, Score, fleet_tree, router_scores
from kvdeck.runtime.fleet.kv_events import Decoder
from kvdeck.runtime.fleet.replica_cache import ReplicaCache
from kvdeck.runtime.fleet.subscriber import SubscriberStatus
from kvdeck.runtime.runs.attach import Rates, parse_metrics
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.server.metrics import ServerMetrics
from kvdeck.runtime.views.snapshot import snapshot_builder

SCRAPE_S = 0.5
"""Wall seconds between two renderings of a replica's metrics (a scrape)."""


class _Latest:
    """What the metrics collector reads: the newest snapshot."""

    latest = None


class LiveReplica:
    """One replica's scrapes and events, written by the fleet's thread, read by the UI."""

    def __init__(self, replica: Replica, model: str):
        self.replica = replica
        self._snapshots = snapshot_builder(replica.engine)
        self._holder = _Latest()
        self._metrics = ServerMetrics([(self._holder, model, (), 0)])
        self._decoder = Decoder()
        self._lock = threading.Lock()
        self.cache = ReplicaCache()
        self.seq = 0
        self.last_message_s: float | None = None
        self.status = self.rates = self.ttft = self.itl = None
        self._scraped_at: tuple[float, float] | None = None
        """(wall, engine) time of the last scrape."""
        replica.publisher.listeners.append(self._events)

    def _events(self, t: float, events: list[dict]) -> None:
        batch = self._decoder.batch(self.seq, msgpack.packb([t, events]))
        with self._lock:
            self.cache.apply(batch)
            self.seq += 1
            self.last_message_s = time.monotonic()

    def scrape(self, force: bool = False) -> None:
        """Render and parse the replica's metrics, at most every `SCRAPE_S` of wall time."""
        now = time.monotonic()
        if not force and self._scraped_at is not None and now - self._scraped_at[0] < SCRAPE_S:
            return
        self._holder.latest = self._snapshots.build()
        status = parse_metrics(self._metrics.render().decode())
        engine_now = self.replica.engine.clock.now()
        with self._lock:
            prev, then = self.status, self._scraped_at
            if prev is not None and then is not None:
                self.rates = Rates.between(prev, status, engine_now - then[1])
                self.ttft, self.itl = delta(prev.ttft, status.ttft), delta(prev.itl, status.itl)
            self.status, self._scraped_at = status, (now, engine_now)

    def row(self) -> ReplicaRow:
        with self._lock:
            events = SubscriberStatus(self.seq, self.last_message_s, tuple(self.cache.gaps),
                                      0, 0, dict(self._decoder.unknown), None)
            age = time.monotonic() - self._scraped_at[0] if self._scraped_at else None
            return ReplicaRow(self.replica.name, "up" if self.status else "starting", "",
                              self.status, self.rates, self.ttft, self.itl, events, age)

    def cache_copy(self) -> ReplicaCache:
        with self._lock:
            return copy.deepcopy(self.cache)


class LiveFleet:
    """A simulated fleet on its own thread, with the calls the fleet screen makes."""

    def __init__(self, cluster: Cluster, arrivals: Sequence[Arrival], pace: float = 1.0,
                 sessions: Sequence = ()):
        self.cluster, self.arrivals, self.pace = cluster, arrivals, pace
        self.sessions = list(sessions)
        model = cluster.replicas[0].engine.executor.info.model_name
        self.replicas = [LiveReplica(r, model) for r in cluster.replicas]
        self.error: str | None = None
        self.done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdeck-fleet", daemon=True)
        cluster.on_step = self._after_step
        self._t0 = 0.0

    def __len__(self) -> int:
        return len(self.replicas)

    def start(self) -> LiveFleet:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.sessions:
            s.close()

    def _pace(self, t: float) -> bool:
        """Hold the loop until the wall clock reaches engine time `t`."""
        if not math.isfinite(t):
            return True  # nothing left to happen: the loop ends by itself
        while not self._stop.is_set():
            ahead = (t - (time.monotonic() - self._t0) * self.pace) / self.pace
            if ahead <= 0:
                return True
            self._stop.wait(min(ahead, 0.25))
            for r in self.replicas:  # idle replicas are scraped too
                r.scrape()
        return False

    def _after_step(self, replica: Replica) -> None:
        self.replicas[self.cluster.replicas.index(replica)].scrape()

    def _run(self) -> None:
        try:
            self.cluster.run(self.arrivals, self._pace)
        except Exception as e:  # noqa: BLE001 - the screen says it; the thread ends
            self.error = str(e)
        for r in self.replicas:
            r.scrape(force=True)
        self.done = True

    # -- what the fleet screen reads ---------------------------------------------------------

    def rows(self) -> list[ReplicaRow]:
        rows = [r.row() for r in self.replicas]
        if self.error:  # the fleet stopped: every row says why
            rows = [dataclasses.replace(row, state="down",
                                        said=f"the fleet stopped: {self.error}")
                    for row in rows]
        return rows

    def caches(self) -> dict[str, ReplicaCache]:
        return {r.replica.name: r.cache_copy() for r in self.replicas}

    def tree(self) -> dict[bytes, FleetNode]:
        return fleet_tree(self.caches())

    def scores(self, prompt: list[int]) -> dict[str, Score]:
        return router_scores(self.caches(), prompt)

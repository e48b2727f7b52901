"""Many replicas watched at once, each on threads of its own: its `/metrics` polled and, where
it publishes them, its KV events subscribed to. A replica that is slow, wrong or gone never
holds up the others: each row says what is wrong with it in one sentence, and the rest keep
updating.

A fleet is a list of URLs, or a TOML file of replicas:

    [[replica]]
    name = "a"                          # optional: the URL's host:port
    url = "http://10.0.0.1:8000"
    kv_events = "tcp://*:5557"          # optional: as the server was told (see subscriber.py)
    kv_replay = "tcp://*:5558"          # optional
    kv_topic = ""                       # optional
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvdeck.runtime.core.config import tomllib
from kvdeck.runtime.errors import ConfigError, KvdeckError
from kvdeck.runtime.fleet.fleet_tree import FleetNode, Score, fleet_tree, router_scores
from kvdeck.runtime.fleet.replica_cache import ReplicaCache
from kvdeck.runtime.fleet.subscriber import Subscriber, SubscriberStatus
from kvdeck.runtime.runs.attach import Histogram, Rates, RemoteStatus, metrics_url, parse_metrics

DOWN_AFTER = 3
"""Failed scrapes in a row after which a replica that answered before is `down`, not stale."""


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_topic: str = ""

    @classmethod
    def of_url(cls, url: str) -> ReplicaSpec:
        metrics_url(url)  # one sentence for a URL that is not one
        return cls(httpx.URL(url).netloc.decode(), url)


def load_fleet(path: str | Path) -> list[ReplicaSpec]:
    """The replicas a fleet file lists (module docstring); one sentence on what is wrong."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"Cannot read fleet file {p}: {e}.") from None
    rows = data.get("replica")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"Fleet file {p} lists no replicas: give [[replica]] tables with a "
                          "url each.")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("url"), str):
            raise ConfigError(f"Fleet file {p}: replica {i + 1} needs a url.")
        unknown = set(row) - {"name", "url", "kv_events", "kv_replay", "kv_topic"}
        if unknown:
            raise ConfigError(f"Fleet file {p}: replica {i + 1} has no field "
                              f"{sorted(unknown)[0]!r} (name, url, kv_events, kv_replay, "
                              "kv_topic).")
        spec = ReplicaSpec.of_url(row["url"])
        out.append(ReplicaSpec(str(row.get("name", spec.name)), row["url"],
                               row.get("kv_events"), row.get("kv_replay"),
                               str(row.get("kv_topic", ""))))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"Fleet file {p}: replica names must differ, got {names}.")
    return out


@dataclass(frozen=True)
class ReplicaRow:
    """One replica as the fleet screen's row shows it."""

    name: str
    state: str
    """`up`, `stale` (its last scrape failed), `down` (several failed, or it never
    answered) or `starting` (no scrape yet)."""
    said: str
    """What is wrong, in one sentence (empty when nothing is)."""
    status: RemoteStatus | None
    rates: Rates | None
    ttft: Histogram | None
    """TTFT between the last two scrapes (bucket deltas): the recent percentiles."""
    itl: Histogram | None
    events: SubscriberStatus | None
    age_s: float | None
    """Seconds since the last good scrape."""


class ReplicaWatch:
    """One replica's poller (and subscriber), each on its own thread."""

    def __init__(self, spec: ReplicaSpec, interval_s: float = 1.0, timeout_s: float = 2.0):
        self.spec, self.interval_s, self.timeout_s = spec, interval_s, timeout_s
        self.metrics_url = metrics_url(spec.url)
        self.subscriber = Subscriber(spec.kv_events, replay=spec.kv_replay,
                                     topic=spec.kv_topic, host=httpx.URL(spec.url).host) \
            if spec.kv_events else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"poll {spec.name}",
                                        daemon=True)
        self.status: RemoteStatus | None = None
        self.rates: Rates | None = None
        self.ttft: Histogram | None = None
        self.itl: Histogram | None = None
        self.last_ok: float | None = None
        self.failures = 0
        self.error = ""

    def start(self) -> ReplicaWatch:
        if self.subscriber is not None:
            self.subscriber.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.subscriber is not None:
            self.subscriber.stop()
        self._thread.join(self.timeout_s + 1)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                self.scrape(client)
                self._stop.wait(self.interval_s)

    def scrape(self, client: httpx.Client) -> None:
        try:
            r = client.get(self.metrics_url)
            r.raise_for_status()
            status = parse_metrics(r.text)
        except httpx.ConnectError:
            self._failed(f"nothing answers at {self.metrics_url}")
        except httpx.TimeoutException:
            self._failed(f"no answer within {self.timeout_s:g} s")
        except httpx.HTTPStatusError as e:
            self._failed(f"{self.metrics_url} answered {e.response.status_code}")
        except (httpx.HTTPError, KvdeckError) as e:
            self._failed(str(e).rstrip("."))
        else:
            now = time.monotonic()
            with self._lock:
                prev, then = self.status, self.last_ok
                if prev is not None and then is not None:
                    self.rates = Rates.between(prev, status, now - then)
                    self.ttft = delta(prev.ttft, status.ttft)
                    self.itl = delta(prev.itl, status.itl)
                self.status, self.last_ok, self.failures, self.error = status, now, 0, ""

    def _failed(self, sentence: str) -> None:
        with self._lock:
            self.failures += 1
            self.error = sentence

    def row(self) -> ReplicaRow:
        with self._lock:
            if self.status is None:
                state = "down" if self.failures else "starting"
            elif self.failures >= DOWN_AFTER:
                state = "down"
            else:
                state = "stale" if self.failures else "up"
            age = time.monotonic() - self.last_ok if self.last_ok is not None else None
            events = self.subscriber.snapshot()[1] if self.subscriber is not None else None
            said = self.error or (events.error or "" if events else "")
            return ReplicaRow(self.spec.name, state, said, self.status, self.rates, self.ttft,
                              self.itl, events, age)

    def cache(self) -> ReplicaCache | None:
        return self.subscriber.snapshot()[0] if self.subscriber is not None else None


def delta(prev: Histogram | None, cur: Histogram | None) -> Histogram | None:
    """The observations between two scrapes of a cumulative histogram (None when the server
    restarted and the counts went back)."""
    if prev is None or cur is None or cur.count < prev.count:
        return None
    before = dict(prev.buckets)
    return Histogram([(le, n - before.get(le, 0.0)) for le, n in cur.buckets],
                     cur.total - prev.total, cur.count - prev.count)


class Fleet:
    """Every replica's watch; what the fleet screen reads."""

    def __init__(self, specs: list[ReplicaSpec], interval_s: float = 1.0):
        self.watches = [ReplicaWatch(s, interval_s) for s in specs]

    def __len__(self) -> int:
        return len(self.watches)

    def start(self) -> Fleet:
        for w in self.watches:
            w.start()
        return self

    def stop(self) -> None:
        for w in self.watches:
            w.stop()

    def rows(self) -> list[ReplicaRow]:
        return [w.row() for w in self.watches]

    def caches(self) -> dict[str, ReplicaCache]:
        """The replicas that publish events, by name."""
        out = {}
        for w in self.watches:
            cache = w.cache()
            if cache is not None:
                out[w.spec.name] = cache
        return out

    def tree(self) -> dict[bytes, FleetNode]:
        return fleet_tree(self.caches())

    def scores(self, prompt: list[int]) -> dict[str, Score]:
        return router_scores(self.caches(), prompt)

"""One replica's KV events over ZeroMQ, applied on a thread of its own.

The publisher binds when its endpoint has a `*` (or is ipc/inproc) and connects otherwise,
as vLLM's does; the subscriber does the other: it connects to the bound address (the `*`
replaced by the server's host) or binds where the publisher will connect. A subscriber that
binds while the publisher binds too receives nothing — that is the pitfall the docs warn of.

Each message is decoded (`kv_events.Decoder`) and applied in sequence order to the replica's
`ReplicaCache`. A jump in the sequence is refilled from the replay endpoint when there is one
(a DEALER asks for everything from the first missing number; the publisher answers with the
buffered messages, then an end marker); otherwise the range is kept as a gap. With a replay
endpoint the subscriber also asks, once connected, for what the publisher still buffers from
sequence 0, so blocks stored before it attached show up as far as that buffer reaches.

Nothing here blocks the caller: `snapshot()` copies what the thread has built, under a lock.
Garbage on the wire is counted and said in one sentence (`error`); the thread keeps reading.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass

import zmq

from kvdeck.runtime.fleet.kv_events import Decoder, EventFormatError
from kvdeck.runtime.fleet.replica_cache import ReplicaCache

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay endpoint's end-of-replay sequence frame."""
RCVHWM = 10_000
"""Messages ZeroMQ queues for a slow subscriber before it drops (then a gap shows)."""


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: a publisher binds a wildcard or ipc/inproc endpoint, connects to any
    other (kvdeck's publisher follows it too)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def plan_socket(endpoint: str, host: str = "127.0.0.1") -> tuple[str, str]:
    """(`connect` or `bind`, address) for a subscriber of a publisher told `endpoint`."""
    if not publisher_binds(endpoint):
        return "bind", endpoint
    return "connect", endpoint.replace("*", host)


@dataclass(frozen=True)
class SubscriberStatus:
    """What the thread has seen, for a row of the fleet screen."""

    messages: int
    last_message_s: float | None
    """Monotonic time of the last message (None: none yet)."""
    gaps: tuple[tuple[int, int], ...]
    refilled: int
    """Messages taken from the replay endpoint."""
    bad: int
    """Messages that could not be decoded."""
    unknown: dict[str, int]
    error: str | None


class Subscriber:
    """A thread applying one replica's events to `cache`."""

    def __init__(self, endpoint: str, *, replay: str | None = None, topic: str = "",
                 host: str = "127.0.0.1", context: zmq.Context | None = None):
        self.endpoint, self.replay, self.topic, self.host = endpoint, replay, topic, host
        self.cache = ReplicaCache()
        self.decoder = Decoder()
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}",
                                        daemon=True)
        self.messages = self.refilled = self.bad = 0
        self.last_message_s: float | None = None
        self.error: str | None = None

    def start(self) -> Subscriber:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def snapshot(self) -> tuple[ReplicaCache, SubscriberStatus]:
        """A copy of the cache as built so far, and the thread's counters."""
        with self._lock:
            cache = copy.deepcopy(self.cache)
            status = SubscriberStatus(self.messages, self.last_message_s,
                                      tuple(cache.gaps), self.refilled, self.bad,
                                      dict(self.decoder.unknown), self.error)
        return cache, status

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        try:
            how, address = plan_socket(self.endpoint, self.host)
            (sock.bind if how == "bind" else sock.connect)(address)
        except zmq.ZMQError as e:
            self.error = f"cannot {how} {address} for KV events: {e}"
            sock.close()
            return
        try:
            if self.replay is not None:
                self._refill(0)
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                self._receive(frames)
        finally:
            sock.close()

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._bad(f"a KV-event message has 3 frames (topic, sequence, payload), got "
                      f"{len(frames)}")
            return
        try:
            batch = self.decoder.batch(frames[1], frames[2])
        except EventFormatError as e:
            self._bad(str(e))
            return
        nxt = self.cache.next_seq
        if nxt is not None and batch.seq > nxt and self.replay is not None:
            self._refill(nxt)
        self._apply(batch, replayed=False)

    def _apply(self, batch, replayed: bool) -> None:
        with self._lock:
            if self.cache.apply(batch):
                self.refilled += replayed
                self.messages += 1
                self.last_message_s = time.monotonic()

    def _bad(self, sentence: str) -> None:
        with self._lock:
            self.bad += 1
            self.error = sentence

    def _refill(self, first: int) -> None:
        """Apply what the replay endpoint buffers from sequence `first` on."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        how, address = plan_socket(self.replay or "", self.host)
        try:
            sock.connect(address)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            while sock.poll(2000):
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                try:
                    batch = self.decoder.batch(frames[2], frames[3])
                except EventFormatError as e:
                    self._bad(str(e))
                    continue
                self._apply(batch, replayed=True)
        except zmq.ZMQError as e:
            self.error = f"replay from {address} failed: {e}"
        finally:
            sock.close()

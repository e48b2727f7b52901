"""kvdeck's own KV events published as vLLM publishes its: `kvdeck serve --kv-events-config`.

Routers and indexers built for vLLM (llm-d's KV-cache indexer, Dynamo's KV router) and
kvdeck's own fleet screen can then follow a kvdeck server as they follow vLLM. After each
engine step that changed the prefix cache, one message goes out — topic, 8-byte big-endian
sequence number (from 0), msgpack batch `[ts, events, data_parallel_rank]` with each event a
map with a `type`, defaults left out, as vLLM 0.32 writes them (the events and their hashes:
`block_events.BlockEvents`). A replay endpoint (a ROUTER) answers a request for everything
from a sequence number with the last `buffer_steps` messages, then an end marker, as
vLLM's does.

The engine thread only turns its events into maps and queues them (bounded: past
`max_queue_size` the oldest waiting message is dropped and the sequence jumps, which a
subscriber sees as a gap); a thread of the publisher's own owns the sockets.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgpack
import zmq

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.fleet.block_events import BlockEvents
from kvdeck.runtime.fleet.subscriber import END_SEQ, publisher_binds


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields (`vllm/config/kv_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str = ""
    """`zmq` or `null`; empty: `zmq` when events are enabled, else `null` (vLLM's rule)."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the JSON a user passes; one sentence naming what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config must be a JSON object ({e.msg}).") from None
        if not isinstance(data, dict):
            raise ConfigError("--kv-events-config must be a JSON object, e.g. "
                              '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'.')
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"--kv-events-config has no field {unknown[0]!r}; the fields are "
                              f"{', '.join(known)}.")
        config = cls(**data)
        kinds = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str,
                 "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
        for name, kind in kinds.items():
            value = getattr(config, name)
            if not isinstance(value, kind) or (kind is int and (isinstance(value, bool)
                                                                or value < 1)):
                raise ConfigError(f"--kv-events-config: {name} must be "
                                  f"{'a positive integer' if kind is int else kind.__name__},"
                                  f" got {value!r}.")
        if config.replay_endpoint is not None and not isinstance(config.replay_endpoint, str):
            raise ConfigError("--kv-events-config: replay_endpoint must be a string or null.")
        if config.publisher not in ("", "zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', got "
                              f"{config.publisher!r}.")
        return config

    @property
    def publishes(self) -> bool:
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and kind == "zmq"


def _open(sock: zmq.Socket, endpoint: str) -> None:
    (sock.bind if publisher_binds(endpoint) else sock.connect)(endpoint)


class EventPublisher:
    """Publishes an engine's prefix-cache changes; `attach(engine)` hooks it in."""

    def __init__(self, config: KVEventsConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self.seq = 0
        self.published = 0
        self.dropped = 0
        self.events = BlockEvents(
            block_size,
            int_hashes=os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events publisher",
                                        daemon=True)

    def start(self) -> EventPublisher:
        """Open the sockets (on the publisher's thread); raises ConfigError if they fail."""
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None:
            raise ConfigError(self.error)
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def attach(self, engine) -> EventPublisher:
        """Publish after each of `engine`'s steps (`Engine.after_step`)."""
        tree = engine.kv.tree
        last = [None, engine.kv.num_resets]

        def after(e) -> None:
            record = e.last_record
            if record is None or record is last[0]:
                return
            last[0] = record
            events = []
            if e.kv.num_resets != last[1]:  # a reset since the last step: vLLM's clear
                last[1] = e.kv.num_resets
                events = self.events.reset(tree)
            self.publish(events + self.events.translate(record.kv, tree), time.time())
        engine.after_step.append(after)
        return self

    def publish(self, events: list[dict], ts: float) -> None:
        """Queue one step's events (nothing when there are none, as vLLM)."""
        if not events:
            return
        payload = msgpack.packb([ts, events])
        try:
            self._queue.put_nowait((self.seq, payload))
        except queue.Full:  # the oldest waiting message goes: subscribers see a gap
            self.dropped += 1
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._queue.put_nowait((self.seq, payload))
        self.seq += 1

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            _open(pub, self.config.endpoint)
            if self.config.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                _open(replay, self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self.error = f"--kv-events-config: cannot open {self.config.endpoint}" + \
                (f" or {self.config.replay_endpoint}" if replay is not None else "") + f": {e}."
            pub.close()
            if replay is not None:
                replay.close()
            self._ready.set()
            return
        self._ready.set()
        topic = self.config.topic.encode()
        try:
            while not self._stop.is_set() or not self._queue.empty():
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay, topic)
                try:
                    seq, payload = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published += 1
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _serve_replay(self, replay: zmq.Socket, topic: bytes) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request; vLLM ignores these too
        client, first = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


"""kvdeck's own KV events published as vLLM publishes its: `kvdeck serve --kv-events-config`.

Routers and indexers built for vLLM (llm-d's KV-cache indexer, Dynamo's KV router) and
kvdeck's own fleet screen can then follow a kvdeck server as they follow vLLM. After each
engine step that changed the prefix cache, one message goes out — topic, 8-byte big-endian
sequence number (from 0), msgpack batch `[ts, events, data_parallel_rank]` with each event a
map with a `type`, defaults left out, as vLLM 0.32 writes them:

    Cache (a block entered the prefix tree)     BlockStored, medium GPU
    Evict (the tree dropped it)                 BlockRemoved, medium GPU (CPU for a block
                                                that lived on the host tier)
    Demote (device -> host tier)                BlockRemoved GPU, then BlockStored CPU
    Promote (host tier -> device)               BlockStored GPU, then BlockRemoved CPU

A block's hash is the one vLLM gives the same tokens (`vllm_block_hash`: its default
`sha256` algorithm, seeded by `PYTHONHASHSEED` as vLLM seeds it), published as vLLM does — the
low 64 bits, or the 32-byte digest under `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` — so an
indexer that hashes request tokens the vLLM way (llm-d's) finds kvdeck's blocks, and kvdeck
replicas sharing the seed name a prefix alike. Only full-attention blocks are published
(kvdeck's own sliding-window pages are not cache entries). A replay endpoint (a ROUTER)
answers a request for everything from a sequence number with the last `buffer_steps`
messages, then an end marker, as vLLM's does.

The engine thread only turns its events into maps and queues them (bounded: past
`max_queue_size` the oldest waiting message is dropped and the sequence jumps, which a
subscriber sees as a gap); a thread of the publisher's own owns the sockets.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgpack
import zmq

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.fleet.kv_events import fold
from kvdeck.runtime.fleet.subscriber import END_SEQ, publisher_binds
from kvdeck.runtime.kv.events import Cache, Demote, Evict, Promote


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


DEFAULT_SEED = "vllm-none-hash"
"""vLLM's seed of the first block's parent hash when `PYTHONHASHSEED` is not set."""


def vllm_block_hash(parent: bytes | None, tokens: tuple[int, ...], seed: str) -> bytes:
    """The hash vLLM's prefix cache gives a full block of `tokens` after the block hashed
    `parent` (None: the first): SHA-256 of the pickled (parent, tokens, extra keys), the
    first block's parent being SHA-256 of the pickled seed (vLLM's default `sha256`
    algorithm; no adapter, no multimodal keys). Checked against a real vLLM 0.32's events
    in `tests/unit/test_kv_events.py`."""
    if parent is None:
        parent = _sha256(seed)
    return _sha256((parent, tuple(tokens), None))


def _sha256(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


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
        self._hashes: dict[int, tuple[int | bytes, bytes]] = {}
        """Cached node id -> (published hash, vLLM's full digest) while the node is cached."""
        self.seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
        self.int_hashes = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
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
        last = [None]

        def after(e) -> None:
            record = e.last_record
            if record is None or record is last[0]:
                return
            last[0] = record
            self.publish(self.translate(record.kv, tree), time.time())
        engine.after_step.append(after)
        return self

    # -- events -----------------------------------------------------------------------------

    def translate(self, kv_events, tree) -> list[dict]:
        """A step's KV events as vLLM event maps."""
        out: list[dict] = []
        for ev in kv_events:
            if isinstance(ev, Cache):
                stored = self._stored(ev, tree)
                if stored is not None:
                    out.append(stored)
            elif isinstance(ev, Evict):
                known = self._hashes.pop(ev.node_id, None)
                if known is not None:
                    out.append(removed(known[0], "CPU" if ev.block < 0 else "GPU"))
            elif isinstance(ev, Demote) and ev.node_id in self._hashes:
                h, tokens_node = self._hashes[ev.node_id][0], tree.nodes.get(ev.node_id)
                out.append(removed(h, "GPU"))
                if tokens_node is not None:
                    out.append(self._store_map(h, tokens_node, "CPU"))
            elif isinstance(ev, Promote) and ev.node_id in self._hashes:
                h, node = self._hashes[ev.node_id][0], tree.nodes.get(ev.node_id)
                if node is not None:
                    out.append(self._store_map(h, node, "GPU"))
                out.append(removed(h, "CPU"))
        return out

    def _stored(self, ev: Cache, tree) -> dict | None:
        node = tree.nodes.get(ev.node_id)
        if node is None or len(node.key) != self.block_size:
            return None  # evicted within the step, or a replayed id-keyed node
        parent = self._hashes.get(ev.parent_id) if ev.parent_id else None
        if ev.parent_id and parent is None:
            return None  # its parent was never published: nothing a subscriber could place
        digest = vllm_block_hash(parent[1] if parent else None, node.key, self.seed)
        h = fold(digest) if self.int_hashes else digest
        self._hashes[ev.node_id] = (h, digest)
        return self._store_map(h, node, "GPU")

    def _store_map(self, h: int | bytes, node, medium: str) -> dict:
        parent = self._hashes.get(node.parent.node_id) if node.parent is not None else None
        return {"type": "BlockStored", "block_hashes": [h],
                "parent_block_hash": parent[0] if parent else None,
                "token_ids": list(node.key), "block_size": self.block_size, "lora_id": None,
                "medium": medium, "lora_name": None, "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}

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


def removed(h: int | bytes, medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0}

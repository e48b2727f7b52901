"""vLLM's KV-cache events, decoded: the messages a vLLM server (or `kvdeck serve
--kv-events-config`) publishes over ZeroMQ when its prefix cache stores or drops blocks.

A message is three frames: the topic, an 8-byte big-endian sequence number (from 0, +1 per
engine step that had events) and a msgpack payload, the batch `[ts, events,
data_parallel_rank]` (or, from other encoders, a map with those keys). Each event is a map
with a `"type"` (vLLM since mid-2026) or a positional array whose first item is the type
(older servers: `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kind, window]`); fields equal to their default are left
out, trailing ones of an array too. Both shapes are read at both levels.

Block hashes are 64-bit integers by default and 32-byte digests when the server runs with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; digests are folded to the integer form the way vLLM
makes it (the low 64 bits, big-endian), so both encodings of one server name a block alike.

Unknown event types and fields are skipped and counted (`Decoder.unknown`), never guessed
at; a payload that is not a batch at all raises `EventFormatError` with one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from kvdeck.runtime.errors import KvdeckError

MASK64 = (1 << 64) - 1


class EventFormatError(KvdeckError):
    """A KV-event message that cannot be read as one."""


def fold(block_hash: int | bytes) -> int:
    """A block hash as vLLM's integer form: a digest's low 64 bits, big-endian."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & MASK64
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash & MASK64
    raise EventFormatError(f"A block hash must be an integer or bytes, got {block_hash!r}.")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the prefix cache, in order, the first a child of `parent`."""

    block_hashes: tuple[int, ...]
    parent: int | None
    """The block before the first one (None: the first is at the start of a sequence)."""
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    """`GPU`, `CPU` (offloaded) or another tier; None: not said (the device)."""
    lora_name: str | None = None
    group: int | None = None
    """The KV-cache group (a hybrid model has several, one per attention kind)."""
    kind: str | None = None
    """`full_attention` or `sliding_window` (None: not said)."""
    window: int | None = None
    """The sliding window in tokens, for a `sliding_window` group."""

    @property
    def blocks(self) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, its tokens) per stored block. A sliding-window group leaves out blocks
        that already slid out of the window, so its hashes name the *last* blocks of
        `token_ids`."""
        n, size = len(self.block_hashes), self.block_size
        if not n:
            return []
        first = len(self.token_ids) // size - n
        return [(h, self.token_ids[(first + i) * size:(first + i + 1) * size])
                for i, h in enumerate(self.block_hashes)]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One message: the events of one engine step."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    rank: int | None = None
    """The data-parallel rank that published it."""


STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window")
"""`BlockStored`'s fields in vLLM's order (the positional form follows it)."""
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
KNOWN_EXTRA = frozenset({"locality", "ownership", "session_id"})
"""Fields newer servers add that the views do not use: skipped, not counted as unknown."""


@dataclass
class Decoder:
    """Decodes messages; counts what it skipped."""

    unknown: dict[str, int] = field(default_factory=dict)
    """Skipped event types and fields, by name, with how often."""

    def _skip(self, name: str) -> None:
        self.unknown[name] = self.unknown.get(name, 0) + 1

    def batch(self, seq: int | bytes, payload: bytes) -> EventBatch:
        """One message's sequence number (int or its 8-byte frame) and payload."""
        if isinstance(seq, bytes):
            if len(seq) != 8:
                raise EventFormatError(f"A sequence frame is 8 bytes, got {len(seq)}.")
            seq = int.from_bytes(seq, "big")
        try:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise EventFormatError(f"Message {seq} is not msgpack ({e}).") from None
        if isinstance(data, dict):
            ts, events, rank = data.get("ts"), data.get("events"), data.get("data_parallel_rank")
        elif isinstance(data, list) and len(data) >= 2:
            ts, events, rank = data[0], data[1], data[2] if len(data) > 2 else None
        else:
            raise EventFormatError(f"Message {seq} is not an event batch: [ts, events, rank] "
                                   f"or a map of them, got {type(data).__name__}.")
        if not isinstance(ts, (int, float)) or not isinstance(events, list):
            raise EventFormatError(f"Message {seq}: a batch needs a number `ts` and a list of "
                                   "events.")
        out = [e for e in map(self.event, events) if e is not None]
        return EventBatch(seq, float(ts), tuple(out), rank if isinstance(rank, int) else None)

    def event(self, raw) -> Event | None:
        """One event, or None for a type this decoder does not know (counted)."""
        if isinstance(raw, dict):
            kind, values = raw.get("type"), raw
        elif isinstance(raw, list) and raw and isinstance(raw[0], str):
            kind = raw[0]
            names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS \
                if kind == "BlockRemoved" else ()
            values = dict(zip(names, raw[1:], strict=False))  # trailing defaults omitted
            for _ in raw[1 + len(names):]:
                self._skip(f"{kind}[{len(names) + 1}+]")
        else:
            raise EventFormatError(f"An event is a map with a `type` or an array led by its "
                                   f"type, got {raw!r:.80}.")
        if kind == "BlockStored":
            return self._stored(values)
        if kind == "BlockRemoved":
            self._extra(values, REMOVED_FIELDS)
            return BlockRemoved(tuple(map(fold, values.get("block_hashes") or ())),
                                values.get("medium"), values.get("group_idx"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        self._skip(str(kind))
        return None

    def _stored(self, v: dict) -> BlockStored:
        self._extra(v, STORED_FIELDS)
        size = v.get("block_size")
        if not isinstance(size, int) or size <= 0:
            raise EventFormatError(f"BlockStored needs a positive block_size, got {size!r}.")
        hashes = tuple(map(fold, v.get("block_hashes") or ()))
        tokens = tuple(v.get("token_ids") or ())
        if len(tokens) < len(hashes) * size:
            raise EventFormatError(f"BlockStored has {len(hashes)} blocks of {size} tokens "
                                   f"but {len(tokens)} token ids.")
        parent = v.get("parent_block_hash")
        return BlockStored(hashes, None if parent is None else fold(parent), tokens, size,
                           v.get("medium"), v.get("lora_name"), v.get("group_idx"),
                           v.get("kv_cache_spec_kind"), v.get("kv_cache_spec_sliding_window"))

    def _extra(self, values: dict, known: tuple[str, ...]) -> None:
        for name in values:
            if name != "type" and name not in known and name not in KNOWN_EXTRA:
                self._skip(name)

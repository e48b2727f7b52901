"""KV events: what `BlockManager` and `PrefixTree` did, in order, each with its JSON form.
Data only; a step record carries them and replay applies them.

KV events (what `BlockManager` and `PrefixTree` did, in order):

    Ref(rid, index, block)        table[rid][index] = block (a new entry, or a replacement)
    Unref(rid, index, block)      the entry at `index` (always the last) is dropped
    Drop(rid, index, block)       token-level eviction (`kv/eviction.py`): the entry at
                                  `index` becomes a hole (−1) and its block is released
    Cow(rid, src, dst)            block `src` was copied into `dst` (already in the table)
    Cache(node, parent, block, end_token)   the block entered the prefix tree
    Evict(node, block)            the prefix tree dropped a block no request used
    Hit(rid, num_tokens)          an admission reused `num_tokens` cached tokens
    Reserve(rid, delta)           change in blocks promised to rid (full reservation)
    Relayout(num_blocks, bytes_per_block, moves)   the pool was re-laid (a KV format
                                  change): used block `old` now lives at `new` for each
                                  [old, new] in `moves`, and the pool has `num_blocks` blocks

Host-tier events (`kv/tiers.py`; device blocks still come and go by Ref/Unref/Cache/Evict):

    SwapOut(rid, pairs)           rid's computed blocks were copied out, [device, host] per
                                  table entry in order; Unrefs of its device table follow
    SwapIn(rid, pairs)            rid's host blocks were copied back, [host, device] each
                                  (its Refs come first); the host blocks are free again
    Unswap(rid)                   rid's host copy was dropped: it will recompute instead
    Demote(node, block, host)     a cached block left the device for host block `host`
    Promote(node, host, block, hit)   a demoted block came back to device block `block`
                                  (hit 1: a host hit, copied back; 0: a request computed the
                                  same block); `Evict` of a host-resident node (block −1)
                                  frees its host block
    HostResize(num_blocks)        the host tier (empty) was re-laid at a new block size
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvdeck.runtime.errors import RunFormatError


class Ref(NamedTuple):
    request_id: str
    index: int
    block: int
    kind = "ref"


class Unref(NamedTuple):
    request_id: str
    index: int
    block: int
    kind = "unref"


class Drop(NamedTuple):
    request_id: str
    index: int
    block: int
    kind = "drop"


class Cow(NamedTuple):
    request_id: str
    src: int
    dst: int
    kind = "cow"


class Cache(NamedTuple):
    node_id: int
    parent_id: int
    block: int
    end_token: int
    kind = "cache"


class Evict(NamedTuple):
    node_id: int
    block: int
    kind = "evict"


class Hit(NamedTuple):
    request_id: str
    num_tokens: int
    kind = "hit"


class Reserve(NamedTuple):
    request_id: str
    delta: int
    kind = "reserve"


class Relayout(NamedTuple):
    num_blocks: int
    bytes_per_block: int
    moves: list[list[int]]
    kind = "relayout"


class SwapOut(NamedTuple):
    request_id: str
    pairs: list[list[int]]
    kind = "swap_out"


class SwapIn(NamedTuple):
    request_id: str
    pairs: list[list[int]]
    kind = "swap_in"


class Unswap(NamedTuple):
    request_id: str
    kind = "unswap"


class Demote(NamedTuple):
    node_id: int
    block: int
    host_block: int
    kind = "demote"


class Promote(NamedTuple):
    node_id: int
    host_block: int
    block: int
    hit: int
    """1: a lookup hit it (copied back); 0: a request computed the same block itself."""
    kind = "promote"


class HostResize(NamedTuple):
    num_blocks: int
    kind = "host_resize"


class WinRef(NamedTuple):
    """A request's sliding-window block `index` now holds `pages` (one per local sub-group,
    `kv/groups.py`): appended, or replacing the pages there (copy-on-write, a cached twin)."""

    request_id: str
    index: int
    pages: list[int]
    kind = "win_ref"


class WinUnref(NamedTuple):
    """A request dropped its sliding-window block `index`: behind the window (freed in
    place) or at the end of its table (truncated or released)."""

    request_id: str
    index: int
    pages: list[int]
    kind = "win_unref"


class WinCache(NamedTuple):
    """The prefix cache keeps node `node_id`'s sliding-window pages."""

    node_id: int
    pages: list[int]
    kind = "win_cache"


class WinEvict(NamedTuple):
    """The prefix cache dropped node `node_id`'s sliding-window pages (the node stays)."""

    node_id: int
    kind = "win_evict"


KVEvent = (Ref | Unref | Drop | Cow | Cache | Evict | Hit | Reserve | Relayout | SwapOut | SwapIn
           | Unswap | Demote | Promote | HostResize | WinRef | WinUnref | WinCache | WinEvict)
KV_EVENTS: dict[str, type] = {c.kind: c for c in (Ref, Unref, Drop, Cow, Cache, Evict, Hit,
                                                   Reserve, Relayout, SwapOut, SwapIn, Unswap,
                                                   Demote, Promote, HostResize, WinRef,
                                                   WinUnref, WinCache, WinEvict)}


def kv_event_to_json(ev: KVEvent) -> list:
    return [ev.kind, *ev]


def kv_event_from_json(item: Any, where: str) -> KVEvent:
    if not isinstance(item, list) or not item:
        raise RunFormatError(f"{where} has a KV event that is not a list: {item!r}.")
    cls = KV_EVENTS.get(item[0])
    if cls is None:
        raise RunFormatError(f"{where} has an unknown KV event kind {item[0]!r}; kinds are "
                             f"{', '.join(KV_EVENTS)}.")
    if len(item) != len(cls._fields) + 1:
        raise RunFormatError(f"{where} has a {item[0]!r} event with {len(item) - 1} fields; "
                             f"it takes {len(cls._fields)} ({', '.join(cls._fields)}).")
    return cls(*item[1:])

"""vLLM's KV-cache events decoded from real payloads (`tests/data/vllm_kv_events/`, recorded
from vLLM 0.32's CPU build by `benchmarks/record_kv_events.py`; its README says how) and
applied to a replica's cache: token for token against the prompts sent, both hash
encodings, sliding-window groups, the older positional form, gaps, and garbage."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest

from kvdeck.runtime.fleet.block_events import vllm_block_hash
from kvdeck.runtime.fleet.fleet_tree import fleet_segments, fleet_tree, router_scores, segments
from kvdeck.runtime.fleet.kv_events import (
    STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Decoder,
    EventBatch,
    EventFormatError,
    fold,
)
from kvdeck.runtime.fleet.replica_cache import ReplicaCache

DATA = Path(__file__).parents[1] / "data" / "vllm_kv_events"
BLOCK = 128
"""vLLM's CPU build stores KV in 128-token blocks."""


def recording(name: str) -> dict:
    return json.loads((DATA / f"vllm_{name}_hashes.json").read_text())


def frames(rec: dict, key: str = "frames") -> list[tuple[int, bytes]]:
    return [(f["seq"], base64.b64decode(f["payload"])) for f in rec[key]]


def full_chains(cache: ReplicaCache) -> set[tuple[int, ...]]:
    """Every cached full-attention path from a root, as its tokens."""
    kids = cache.children()
    out: set[tuple[int, ...]] = set()

    def walk(parent, tokens):
        for b in kids.get(parent, ()):
            if 5 in b.residency:  # Gemma 3's full-attention group
                path = tokens + b.tokens
                out.add(path)
                walk(b.block_hash, path)
    walk(None, ())
    return out


@pytest.mark.parametrize("name", ["int", "bytes"])
def test_real_events_rebuild_the_prompts_block_for_block(name: str) -> None:
    rec = recording(name)
    prompts = rec["prompts"]
    dec, cache = Decoder(), ReplicaCache()
    batches = [dec.batch(seq, payload) for seq, payload in frames(rec)]
    assert dec.unknown == {} and [b.seq for b in batches] == list(range(len(batches)))
    # The first step stores prompt 0's two full blocks in each of Gemma 3's six groups:
    # five sliding-window groups (window 512), then the full-attention one.
    first = batches[0].events
    assert [(e.group, e.kind, e.window) for e in first] == \
        [(g, "sliding_window", 512) for g in range(5)] + [(5, "full_attention", None)]
    assert all(e.token_ids == tuple(prompts[0][:2 * BLOCK]) for e in first)
    # One hash per block, the same in every group.
    assert len({e.block_hashes for e in first}) == 1
    seen: set[tuple[int, ...]] = set()
    for b in batches[:-1]:
        cache.apply(b)
        seen |= full_chains(cache)
    # Every prompt's full blocks were cached at some point (the shared prefix once), and
    # nothing else was: a prefix-cache hit publishes nothing.
    want = {tuple(p[:k * BLOCK]) for p in prompts for k in range(1, len(p) // BLOCK + 1)}
    assert seen == want
    # The small pool evicted: early prompts' blocks are gone by the end.
    assert tuple(prompts[3][:BLOCK]) not in full_chains(cache)
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)
    # The reset: the last message clears everything, then prompt 0 is stored again.
    last = batches[-1]
    assert isinstance(last.events[0], AllBlocksCleared)
    cache.apply(last)
    assert full_chains(cache) == {tuple(prompts[0][:BLOCK]), tuple(prompts[0][:2 * BLOCK])}
    assert cache.clears == 1 and cache.gaps == [] and cache.resident() == 2


def test_sliding_window_groups_leave_out_what_slid_out() -> None:
    """A 640-token prompt in 128-token blocks: the full-attention group lists 5 hashes, each
    window group (512 tokens) only the last 4; the cache still knows every parent."""
    rec = recording("int")
    dec, cache = Decoder(), ReplicaCache()
    for seq, payload in frames(rec)[:2]:
        cache.apply(dec.batch(seq, payload))
    window, full = dec.batch(*frames(rec)[1]).events[0], dec.batch(*frames(rec)[1]).events[5]
    assert len(window.token_ids) == 5 * BLOCK and len(window.block_hashes) == 4
    assert window.block_hashes == full.block_hashes[1:]
    assert [t for _, t in window.blocks] == [t for _, t in full.blocks][1:]
    chain = [cache.blocks[h] for h in full.block_hashes]
    assert all(b.parent_known for b in chain)
    assert [b.parent for b in chain] == [None, *full.block_hashes[:-1]]
    assert all(sorted(b.residency) == list(range(6)) for b in chain[1:])
    assert sorted(chain[0].residency) == [5]  # slid out of every window group


def test_both_hash_encodings_name_a_block_alike() -> None:
    """The two recordings ran the same prompts with the same PYTHONHASHSEED: the 32-byte
    digests, folded, are the integer hashes."""
    hashes = {}
    for name in ("int", "bytes"):
        dec = Decoder()
        hashes[name] = [h for seq, p in frames(recording(name)) for e in dec.batch(seq, p).events
                        if isinstance(e, BlockStored) for h in e.block_hashes]
    raw = msgpack.unpackb(frames(recording("bytes"))[0][1], raw=False)
    assert isinstance(raw[1][0]["block_hashes"][0], bytes)
    assert len(raw[1][0]["block_hashes"][0]) == 32
    assert hashes["int"] == hashes["bytes"] and len(hashes["int"]) > 100
    assert fold(b"\x01" * 24 + (5).to_bytes(8, "big")) == 5


def positional(event: dict) -> list:
    """An event map in the older servers' positional form (vLLM's field order, trailing
    defaults left out) — written here, since no such server is installed to record one."""
    kind = event["type"]
    names = STORED_FIELDS if kind == "BlockStored" else ("block_hashes", "medium", "group_idx") \
        if kind == "BlockRemoved" else ()
    row = [kind] + [event.get(n) for n in names]
    while len(row) > 1 and row[-1] is None:
        row.pop()
    return row


def test_the_positional_form_decodes_as_the_map_form() -> None:
    for seq, payload in frames(recording("int")):
        ts, events, *rank = msgpack.unpackb(payload, raw=False)
        as_arrays = msgpack.packb([ts, [positional(e) for e in events], *rank])
        as_map = msgpack.packb({"ts": ts, "events": events})
        want = Decoder().batch(seq, payload)
        assert Decoder().batch(seq, as_arrays).events == want.events
        assert Decoder().batch(seq, as_map).events == want.events


def test_gaps_are_marked_and_refilled_and_old_messages_dropped() -> None:
    batches = [Decoder().batch(s, p) for s, p in frames(recording("int"))]
    cache = ReplicaCache()
    cache.apply(batches[0])
    cache.apply(batches[3])  # 1 and 2 lost
    assert cache.gaps == [(1, 2)]
    assert not cache.apply(batches[2])  # too late: older than the next expected
    cache.refilled(1, 2)
    assert cache.gaps == []
    # The replay endpoint's answer is the live stream, message for message.
    rec = recording("int")
    assert frames(rec, "replay") == frames(rec)


def test_unknown_types_and_fields_are_counted_and_garbage_named() -> None:
    dec = Decoder()
    payload = msgpack.packb([1.0, [{"type": "BlockMoved", "x": 1},
                                   {"type": "BlockRemoved", "block_hashes": [7], "tier": 2},
                                   ["AllBlocksCleared"]]])
    b = dec.batch((9).to_bytes(8, "big"), payload)
    assert b.seq == 9 and b.events == (BlockRemoved((7,)), AllBlocksCleared())
    assert dec.unknown == {"BlockMoved": 1, "tier": 1}
    for bad, said in ((b"\xc1", "not msgpack"), (msgpack.packb("hello"), "not an event batch"),
                      (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                             "token_ids": [1], "block_size": 16}]]),
                       "1 blocks of 16 tokens but 1 token ids")):
        with pytest.raises(EventFormatError, match=said):
            dec.batch(1, bad)
    with pytest.raises(EventFormatError, match="8 bytes"):
        dec.batch(b"\x00", payload)


def test_a_late_subscriber_gets_placeholders_for_what_it_missed() -> None:
    batches = [Decoder().batch(s, p) for s, p in frames(recording("int"))]
    cache = ReplicaCache()
    stored = next(e for e in batches[1].events if e.kind == "full_attention")
    tail = BlockStored(stored.block_hashes[2:], stored.block_hashes[1],
                       stored.token_ids[2 * BLOCK:], BLOCK, group=5, kind="full_attention")
    cache.apply(type(batches[1])(1, 0.0, (tail,)))
    placeholder = cache.blocks[stored.block_hashes[1]]
    assert placeholder.placeholder and placeholder.tokens is None
    assert cache.key(stored.block_hashes[2]) is None  # its prefix is unknown
    assert cache.roots() == [placeholder]


def replica(name: str, upto: int | None = None) -> ReplicaCache:
    cache, dec = ReplicaCache(), Decoder()
    for seq, payload in frames(recording(name))[:upto]:
        cache.apply(dec.batch(seq, payload))
    return cache


def test_segments_fold_chains_and_say_where_they_live() -> None:
    prompts = recording("int")["prompts"]
    segs = segments(replica("int", 3))
    # Prompts 3 and 4 (5 blocks each), then prompt 0's two (the shared prefix).
    heads = [s for s in segs if s.parent_id == 0]
    assert [(s.start_token, s.num_blocks) for s in heads] == [(0, 1), (0, 1), (0, 2)]
    first, rest = heads[0], next(s for s in segs if s.parent_id == heads[0].seg_id)
    # A 640-token prompt's first block slid out of the five window groups.
    assert first.groups == (5,) and rest.groups == (0, 1, 2, 3, 4, 5)
    assert (rest.start_token, rest.end_token, rest.media) == (128, 640, ("GPU",))
    assert first.tokens + rest.tokens == tuple(prompts[3][:640])
    assert heads[2].tokens == tuple(prompts[0][:256])


def test_the_fleet_tree_and_router_scores_go_by_content() -> None:
    prompts = recording("int")["prompts"]
    caches = {"a": replica("int", 3), "b": replica("bytes")}  # b: after its reset
    tree = fleet_tree(caches)
    both = [n for n in tree.values() if set(n.replicas) == {"a", "b"}]
    assert sorted(len(n.tokens) for n in both) == [BLOCK, BLOCK]
    assert {n.tokens for n in both} == {tuple(prompts[0][:BLOCK]),
                                       tuple(prompts[0][BLOCK:2 * BLOCK])}
    assert sum(1 for n in tree.values() if set(n.replicas) == {"a"}) == 10
    scores = router_scores(caches, prompts[3])
    assert scores["a"] == (5, 5.0, 640) and scores["b"] == (0, 0.0, 0)
    scores = router_scores(caches, prompts[1])  # the shared 256 tokens, then its own
    assert scores["a"].blocks == scores["b"].blocks == 2
    # A block that lives only on the host tier counts 0.8 (llm-d's CPU weight).
    host = ReplicaCache()
    host.apply(EventBatch(0, 0.0, (BlockStored((7,), None, tuple(prompts[0][:BLOCK]), BLOCK,
                                               medium="CPU", group=5),)))
    assert router_scores({"host": host}, prompts[0])["host"] == (1, 0.8, BLOCK)


def test_fleet_segments_mark_which_replicas_hold_what() -> None:
    prompts = recording("int")["prompts"]
    segs = fleet_segments(fleet_tree({"a": replica("int", 3), "b": replica("bytes")}))
    shared = segs[0]  # held by both: first
    assert shared.replicas == (("a", ("GPU",)), ("b", ("GPU",)))
    assert (shared.start_token, shared.num_tokens, shared.num_blocks) == (0, 256, 2)
    assert shared.tokens == tuple(prompts[0][:256])
    only_a = [s for s in segs if s.replicas == (("a", ("GPU",)),)]
    assert sorted(s.num_tokens for s in only_a) == [640, 640]


def test_kvdeck_hashes_blocks_as_vllm_does() -> None:
    """`vllm_block_hash` (what `kvdeck serve --kv-events-config` publishes) gives a real vLLM
    0.32's block hashes for the same tokens: the recordings ran with PYTHONHASHSEED=0."""
    for name in ("int", "bytes"):
        rec = recording(name)
        dec = Decoder()
        for seq, payload in frames(rec)[:4]:
            for e in dec.batch(seq, payload).events:
                if not isinstance(e, BlockStored) or e.kind != "full_attention":
                    continue
                parent = None
                assert e.parent is None  # every prompt here starts a sequence
                for h, tokens in e.blocks:
                    digest = vllm_block_hash(parent, tokens, "0")
                    assert fold(digest) == h
                    parent = digest
        if name == "bytes":  # the digests themselves, not only their low 64 bits
            raw = msgpack.unpackb(frames(rec)[0][1], raw=False)[1]
            first = next(x for x in raw if x.get("kv_cache_spec_kind") == "full_attention")
            assert first["block_hashes"][0] == vllm_block_hash(
                None, tuple(first["token_ids"][:BLOCK]), "0")


def test_an_adapters_blocks_are_hashed_and_named_with_it() -> None:
    """A block computed under a LoRA adapter is published as vLLM publishes it: the
    adapter's name among the hash's extra keys and in `lora_name`. The same tokens under
    the base model hash differently and carry no name."""
    from kvdeck.runtime.core.request import Request, SamplingParams
    from kvdeck.runtime.fleet.block_events import BlockEvents
    from kvdeck.runtime.kv.manager import BlockManager

    mgr = BlockManager(32, 4)
    events = BlockEvents(4, seed="0")
    tokens = list(range(10, 19))
    for rid, lora in (("base", None), ("tuned", "capitals")):
        req = Request(rid, tokens, SamplingParams(max_tokens=2, lora=lora))
        mgr.admit(req, len(tokens), False)
        req.num_computed_tokens = len(tokens)
        mgr.cache_computed(req)
    stored = [e for e in events.translate(mgr.take_events(), mgr.tree)
              if e["type"] == "BlockStored"]
    by_name: dict = {}
    for e in stored:
        by_name.setdefault(e["lora_name"], []).append(e)
    assert set(by_name) == {None, "capitals"}
    for lora, blocks in by_name.items():
        parent = None
        for e in blocks:
            digest = vllm_block_hash(parent, tuple(e["token_ids"]), "0", lora)
            assert e["block_hashes"] == [fold(digest)]
            parent = digest
    assert by_name[None][0]["block_hashes"] != by_name["capitals"][0]["block_hashes"]

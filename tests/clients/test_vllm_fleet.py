"""The fleet against real vLLM: two replicas of vLLM 0.32's CPU build with KV events on,
watched by kvdeck's fleet — the tree equals what the events say token for token, an
eviction removes the node, a reset clears the replica, a replica killed mid-run is marked
down while the other stays live.

Under `make clients` only (`KVDECK_CLIENTS=1`): each replica takes a minute or two to start
on two cores. The replicas share `PYTHONHASHSEED` (their block hashes then agree) and run in
dev mode for `POST /reset_prefix_cache`.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from benchmarks import peers
from kvdeck.runtime.fleet.fleet import Fleet, ReplicaSpec
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from tests.clients import PEERS

BLOCK = 128
"""vLLM's CPU build stores KV in 128-token blocks."""
FULL_GROUP = 5
"""Gemma 3's full-attention KV-cache group (five sliding-window groups come first)."""

pytestmark = [
    pytest.mark.slow,
    PEERS,
]


def start_replica(name: str, *flags: str) -> tuple[peers.Server, ReplicaSpec]:
    pub, replay = peers.free_port(), peers.free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv"}
    server = peers.vllm(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, 2, "--kv-events-config",
                        json.dumps(config), "--max-model-len", "1024", "--max-num-seqs", "4",
                        *flags)
    server.env.update(PYTHONHASHSEED="0", VLLM_SERVER_DEV_MODE="1")
    return server, ReplicaSpec(name, server.url.removesuffix("/v1"), config["endpoint"],
                               config["replay_endpoint"], "kv")


def complete(server: peers.Server, prompt: list[int]) -> None:
    r = httpx.post(server.url + "/completions", timeout=300, json={
        "model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    r.raise_for_status()


def chains(cache) -> set[tuple[int, ...]]:
    """Every full-attention path from a root, as its tokens."""
    kids = cache.children()
    out = set()

    def walk(parent, tokens):
        for b in kids.get(parent, ()):
            if FULL_GROUP in b.residency:
                out.add(tokens + b.tokens)
                walk(b.block_hash, tokens + b.tokens)
    walk(None, ())
    return out


def blocks_of(prompts) -> set[tuple[int, ...]]:
    return {tuple(p[:k * BLOCK]) for p in prompts for k in range(1, len(p) // BLOCK + 1)}


def until(check, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


def test_two_vllm_replicas_as_one_fleet() -> None:
    rng = random.Random(9)
    big, a = start_replica("a")
    small, b = start_replica("b", "--num-gpu-blocks-override", "96")
    fleet = Fleet([a, b], interval_s=0.5)
    try:
        fleet.start()  # subscribe before the servers bind: nothing is missed
        big.start(DEFAULT_MODEL)
        small.start(DEFAULT_MODEL)
        prefix = [rng.randrange(1000, 30000) for _ in range(2 * BLOCK + 44)]
        sent = {"a": [], "b": []}
        for name, server in (("a", big), ("b", small)):
            for _ in range(2):
                p = prefix + [rng.randrange(1000, 30000) for _ in range(BLOCK)]
                complete(server, p)
                sent[name].append(p)
        until(lambda: all(chains(c) == blocks_of(sent[n]) for n, c in fleet.caches().items()))
        # The shared prefix's two blocks are one node each, held by both replicas.
        tree = fleet.tree()
        both = sorted((n.tokens for n in tree.values() if set(n.replicas) == {"a", "b"}),
                      key=lambda t: prefix.index(t[0]))
        assert both == [tuple(prefix[:BLOCK]), tuple(prefix[BLOCK:2 * BLOCK])]
        assert fleet.scores(sent["a"][0])["a"].blocks == 3
        assert fleet.scores(sent["a"][0])["b"].blocks == 2

        # An eviction: distinct prompts through b's 96-block pool push the prefix out.
        for _ in range(10):
            complete(small, [rng.randrange(1000, 30000) for _ in range(6 * BLOCK)])
        until(lambda: tuple(prefix[:BLOCK]) not in chains(fleet.caches()["b"]))
        node = next(n for n in fleet.tree().values() if n.tokens == tuple(prefix[:BLOCK]))
        assert set(node.replicas) == {"a"}

        # A reset clears a; its next step publishes it, with the next request's blocks.
        assert httpx.post(big.url.removesuffix("/v1") + "/reset_prefix_cache",
                          timeout=60).status_code == 200
        again = [rng.randrange(1000, 30000) for _ in range(BLOCK + 5)]
        complete(big, again)
        until(lambda: chains(fleet.caches()["a"]) == blocks_of([again]))
        assert fleet.caches()["a"].clears == 1

        # b is killed: its row goes down, a stays up and keeps publishing.
        small.kill()
        until(lambda: {r.name: r.state for r in fleet.rows()} == {"a": "up", "b": "down"})
        before = fleet.rows()[0].events.messages
        complete(big, [rng.randrange(1000, 30000) for _ in range(2 * BLOCK)])
        until(lambda: fleet.rows()[0].events.messages > before)
    finally:
        fleet.stop()
        big.stop()
        small.stop()

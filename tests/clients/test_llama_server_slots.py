"""`calibrate --url` behind llama-server's slots: its `/props` say how many it runs, and a
decode probe's `b` requests, sent with `id_slot`, take slots 0 to `b − 1` (its `/slots`
show which slots held them), so that each step the probe times is one pass of `b` rows
(`executors/server_slots.py`); and what saving an idle slot to its prompt cache takes
(`planning/slot_save.py`).

Under `make clients` only (`KVDECK_CLIENTS=1`): llama-server builds into .venv-clients/ on
first use (benchmarks/peers.py), about 12 minutes on two cores.
"""

from __future__ import annotations

import dataclasses
import random

import httpx
import pytest

from benchmarks import peers
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.planning.calibrate import Point
from kvdeck.runtime.planning.probe import Probes, llama_server_slots, probe, save_point
from kvdeck.runtime.planning.profiles import ModelProfile
from kvdeck.runtime.runs.endpoints import server_root
from tests.clients import PEERS

pytestmark = [
    pytest.mark.slow,
    PEERS,
]


def test_decode_probes_run_in_neighbouring_slots() -> None:
    # `--no-repack`: the one start that works on every CPU here (benchmarks/peers.py).
    server = peers.llama_server(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, 2, repack=False)
    try:
        server.start(DEFAULT_MODEL)
        assert llama_server_slots(server.url) == 8
        # Three rows of 64-token prompts; the start's "Hello" and the probe's 16-token
        # warm-up go to whichever slots llama-server picks, and are shorter. A save timed
        # before (as the benchmark's speed checks pass it) is taken, not returned.
        save = Point("save", 1536, 0, "save 1536", 0.020, 1536)
        (point,) = probe(server.url, DEFAULT_MODEL, Probes((), ((3, 64),), 8, 1),
                         progress=lambda m: None, shape=ModelProfile.load(DEFAULT_MODEL),
                         save=save)
        slots = httpx.get(server_root(server.url) + "/slots", timeout=30).json()
    finally:
        server.stop()
    assert point.kind == "decode" and point.new_tokens == 3 and point.pinned
    held = {s["id"] for s in slots if s.get("n_prompt_tokens", 0) >= 64}
    assert held == {0, 1, 2}


def test_a_slot_save_is_timed_and_is_gone_without_the_prompt_cache() -> None:
    """`save_point` on llama-server as started (its prompt cache on, `--cache-ram` 8 GiB):
    a 1,536-token slot's state (12 MiB) takes milliseconds to save; started with
    `--cache-ram 0`, it saves nothing, and what noise leaves of the point is a fraction."""
    shape = ModelProfile.load(DEFAULT_MODEL)
    timed = {}
    for flags in ((), ("--cache-ram", "0")):
        base = peers.llama_server(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, 2,
                                  repack=False)
        server = dataclasses.replace(base, argv=[*base.argv, *flags])
        try:
            server.start(DEFAULT_MODEL)
            point = save_point(server.url, DEFAULT_MODEL, random.Random(0), 6,
                               lambda n: shape.kv_bytes(n, 1), None)
        finally:
            server.stop()
        timed[flags] = point.seconds if point else 0.0
    assert timed[()] > 0.005
    assert timed[("--cache-ram", "0")] < timed[()] / 3

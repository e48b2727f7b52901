"""The simulated fleet run live for the fleet screen (`runtime/cluster/live.py`): its rows
come from each replica's /metrics text and its tree from each replica's KV events, as for
real servers; the screen draws it in a pilot."""

from __future__ import annotations

import asyncio
import time

from kvdeck.console.screens.fleet import FleetApp
from kvdeck.runtime.cluster.live import LiveFleet
from kvdeck.runtime.cluster.replicas import Cluster, ClusterConfig, replica_roles
from kvdeck.runtime.runs.trace import load_arrivals
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve


def live_fleet(pace: float) -> LiveFleet:
    settings = resolve({}, {"executor": "sim", "kv_memory_bytes": 2 << 30},
                       default_executor="sim")
    sessions = [build_session(settings, with_tokenizer=False) for _ in range(3)]
    cluster = Cluster([s.engine for s in sessions], replica_roles(3, 0, 0),
                      ClusterConfig(router="weighted"), vocab_size=sessions[0].vocab_size)
    return LiveFleet(cluster, load_arrivals("mooncake-conversation", limit=20), pace,
                     sessions)


def test_a_live_fleet_reads_like_real_servers():
    fleet = live_fleet(pace=1000.0).start()
    try:
        deadline = time.monotonic() + 120
        while not fleet.done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet.done and fleet.error is None
        rows = fleet.rows()
        assert [r.name for r in rows] == ["r0", "r1", "r2"]
        assert all(r.state == "up" and r.status is not None for r in rows)
        # Every request ended somewhere; each replica's /metrics counts its finished ones.
        ended = [m for r in fleet.cluster.replicas for m in r.metrics]
        assert len(ended) == 20
        for row, replica in zip(rows, fleet.cluster.replicas, strict=True):
            assert row.status.requests_done == sum(
                1 for m in replica.metrics if m.status.startswith("finished"))
        caches = fleet.caches()
        engine_blocks = {r.name: sum(1 for n in r.engine.kv.tree.nodes.values()
                                     if n.block >= 0)
                         for r in fleet.cluster.replicas}
        for name, cache in caches.items():
            assert cache.resident() == engine_blocks[name]
        assert fleet.tree()
    finally:
        fleet.stop()


def test_the_fleet_screen_draws_a_live_fleet():
    async def run() -> str:
        app = FleetApp(live_fleet(pace=50.0), interval_s=0.2, title="simulated fleet")
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(2.0)
            text = app.screen._compositor.render_update(full=True)
            return str(text) + str(app.query_one("#replicas").row_count)
    out = asyncio.run(run())
    assert out.endswith("3")

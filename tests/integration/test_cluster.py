"""The simulated fleet (`runtime/cluster/`): many sim engines on one clock behind the
routers, disaggregated prefill and decode, and what they report."""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

from kvdeck.runtime.cluster.handoff import transfer_seconds
from kvdeck.runtime.cluster.replicas import Cluster, ClusterConfig, replica_roles
from kvdeck.runtime.cluster.routers import ROUTERS, make_router
from kvdeck.runtime.cluster.run import run_fleet
from kvdeck.runtime.errors import ConfigError, TraceError
from kvdeck.runtime.planning.parallel import Layout
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.runs.trace import Arrival, load_arrivals
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from kvdeck.runtime.stats.metrics import SLO

SIM = resolve({}, {"executor": "sim"}, default_executor="sim")
SMALL = resolve({}, {"executor": "sim", "kv_memory_bytes": 2 << 30}, default_executor="sim")
"""A 2 GiB pool: checking every replica's KV after every step walks the whole pool."""
ALL_ROUTERS = ["round-robin", "random", "least-loaded", "prefix", "weighted", "cost",
               "cost:temperature=0.5"]


def fleet(roles, config=ClusterConfig(), settings=SIM):
    sessions = [build_session(settings, with_tokenizer=False) for _ in roles]
    cluster = Cluster([s.engine for s in sessions], roles, config,
                      vocab_size=sessions[0].vocab_size)
    return cluster, sessions


def mooncake_run(router: str) -> tuple[list[str], list[int], int, bool]:
    """One router's integrity-checked fleet run of the Mooncake excerpt: its requests' ids,
    each replica's count, the replica count, and whether a seeded repeat (without the KV
    walks) gave the same requests, byte for byte (True where none is made)."""
    arrivals = load_arrivals("mooncake-conversation", limit=30)
    config = ClusterConfig(router=router, check_integrity=True)
    result = run_fleet(SMALL, replica_roles(4, 0, 0), config, arrivals)
    same = True
    if router in ("random", "cost:temperature=0.5"):  # the two with a seeded draw
        again = run_fleet(SMALL, replica_roles(4, 0, 0), ClusterConfig(router=router),
                          arrivals)
        same = json.dumps(again["requests"]) == json.dumps(result["requests"])
    return ([r["request_id"] for r in result["requests"]],
            [row["requests"] for row in result["replicas"]],
            result["summary"]["num_replicas"], same)


def test_every_router_runs_mooncake_and_loses_nothing():
    """Four replicas on the Mooncake excerpt: every request ends once, on some replica, with
    every replica's KV invariants checked after each of its steps; seeded runs repeat."""
    assert sorted(ROUTERS) == sorted({r.split(":")[0] for r in ALL_ROUTERS})
    # The runs are independent and single-threaded, and the KV walks make them long: two
    # spawned processes share them (not forked from a process holding torch's threads).
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        runs = dict(zip(ALL_ROUTERS, pool.map(mooncake_run, ALL_ROUTERS), strict=True))
    for router, (ids, per_replica, num_replicas, same) in runs.items():
        assert sorted(ids) == sorted(f"r{i}" for i in range(30)), router
        assert sum(per_replica) == 30, router
        assert num_replicas == 4, router
        assert same, router


def test_round_robin_spreads_evenly():
    arrivals = [Arrival(i * 0.01, 64, 4) for i in range(40)]
    result = run_fleet(SIM, replica_roles(4, 0, 0), ClusterConfig(), arrivals)
    assert [row["requests"] for row in result["replicas"]] == [10, 10, 10, 10]


def group_arrivals(groups: int, per_group: int, gap: float) -> list[Arrival]:
    """Requests of `groups` shared 2,048-token prefixes, the groups interleaved."""
    return [Arrival(i * gap, 2048 + 64, 8, prefix_group=f"g{i % groups}", prefix_len=2048)
            for i in range(groups * per_group)]


def test_prefix_router_keeps_a_prefix_on_one_replica_and_load_routing_does_not():
    arrivals = group_arrivals(3, 8, 1.0)  # 3 groups over 4 replicas: round-robin rotates
    by_router = {}
    for router in ("prefix", "round-robin"):
        cluster, sessions = fleet(replica_roles(4, 0, 0), ClusterConfig(router=router))
        cluster.run(arrivals)
        holders: dict[str, set[str]] = {}
        for r in cluster.replicas:
            for m in r.metrics:
                group = f"g{int(m.request_id[1:]) % 3}"
                holders.setdefault(group, set()).add(r.name)
        by_router[router] = (holders, sum(r.engine.kv.tree.num_hit_tokens
                                          for r in cluster.replicas))
        for s in sessions:
            s.close()
    holders, hits = by_router["prefix"]
    assert all(len(h) == 1 for h in holders.values()), holders
    rr_holders, rr_hits = by_router["round-robin"]
    assert any(len(h) > 1 for h in rr_holders.values())
    assert hits > rr_hits


def test_a_stale_router_cannot_see_the_cache():
    """With events arriving later than the requests are spaced, the prefix router has
    nothing to go by and spreads a group like a load router."""
    arrivals = group_arrivals(1, 8, 0.5)
    cluster, sessions = fleet(replica_roles(4, 0, 0),
                              ClusterConfig(router="prefix", staleness_s=100.0))
    cluster.run(arrivals)
    assert sum(1 for r in cluster.replicas if r.metrics) > 1
    for s in sessions:
        s.close()


def test_session_affinity_keeps_a_conversation_on_one_replica():
    arrivals = [Arrival(i * 0.2, 128, 4, session=f"chat{i % 4}") for i in range(12)]
    for affinity, spread in ((True, False), (False, True)):
        cluster, sessions = fleet(replica_roles(3, 0, 0),
                                  ClusterConfig(session_affinity=affinity))
        cluster.run(arrivals)
        where: dict[str, set[str]] = {}
        for r in cluster.replicas:
            for m in r.metrics:
                where.setdefault(f"chat{int(m.request_id[1:]) % 4}", set()).add(r.name)
        assert any(len(v) > 1 for v in where.values()) is spread
        for s in sessions:
            s.close()


def run_pd(prompt: int, rate: float, roles, slo: SLO) -> dict:
    arrivals = [Arrival(i / rate, prompt, 256) for i in range(60)]
    return run_fleet(SIM, roles, ClusterConfig(check_integrity=True), arrivals, slo=slo)


def test_disaggregation_wins_on_long_prompts_under_a_tight_itl_slo():
    """Two cards: aggregated (two replicas) against one prefill and one decode instance.
    8,000-token prompts: on aggregated replicas every prefill chunk stretches the decode
    steps it shares, so few requests keep a 30 ms TPOT; disaggregated decode steps carry
    no prefill."""
    slo = SLO(None, 0.03, None)
    # Two independent integrity-checked runs, one spawned process each (as above).
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        agg, pd = (r["summary"] for r in pool.map(
            run_pd, [8000] * 2, [2.0] * 2, [replica_roles(2, 0, 0), replica_roles(1, 1, 1)],
            [slo] * 2))
    assert pd["goodput_rps"] > 3 * agg["goodput_rps"]
    assert pd["itl_s"]["p99"] < agg["itl_s"]["p99"]
    assert pd["kv_moved_bytes"] > 0 and pd["transfer_s_mean"] > 0
    assert pd["num_requests"] == agg["num_requests"] == 60


def test_disaggregation_loses_on_short_prompts():
    """256-token prompts: prefill is cheap, so the prefill card sits idle most of the time
    while aggregated serving decodes on both cards; the report shows the idle capacity."""
    slo = SLO(None, 0.03, None)
    agg = run_pd(256, 40.0, replica_roles(2, 0, 0), slo)["summary"]
    pd = run_pd(256, 40.0, replica_roles(1, 1, 1), slo)["summary"]
    assert agg["goodput_rps"] > pd["goodput_rps"]
    assert pd["prefill_idle_share"] > 0.5
    assert pd["ttft_s"]["p50"] > agg["ttft_s"]["p50"]


def test_transfer_overlaps_layer_by_layer():
    assert transfer_seconds(64e9, 64e9, 0.0, 32, "after") == pytest.approx(1.0)
    # Fully hidden but for the last layer's share.
    assert transfer_seconds(64e9, 64e9, 10.0, 32, "layerwise") == pytest.approx(1 / 32)
    assert transfer_seconds(64e9, 64e9, 0.5, 32, "layerwise") == pytest.approx(
        1.0 - 0.5 * 31 / 32)


def test_a_tensor_parallel_replica_splits_its_step():
    """Llama-70B on H100 SXM: a decode step at TP4 reads a quarter of the weights per card,
    plus its all-reduces; the KV budget is what four cards leave."""
    model, hw = ModelProfile.load("llama-70b"), HardwareProfile.load("h100-sxm")
    settings = resolve({}, {"executor": "sim", "model_profile": "llama-70b",
                            "hardware": "h100-sxm", "tensor_parallel": 4,
                            "memory_utilization": 0.9}, default_executor="sim")
    s = build_session(settings, with_tokenizer=False)
    ex = s.executor
    assert ex.timing == "roofline"
    one = model.matrix_weight_bytes / (hw.bandwidth_bytes_per_s * hw.mbu)
    step = ex.estimate_step_seconds(1, 1, 1)
    assert one / 4 < step < one / 4 * 1.05
    budget = Layout(4).kv_budget_bytes(model, hw, 0.9)
    assert s.engine.kv.num_blocks == budget // (16 * model.kv_bytes_per_token())
    s.close()


@pytest.mark.parametrize("make, match", [
    (lambda: make_router("closest"), "Unknown router 'closest'; the routers are"),
    (lambda: make_router("weighted:depth=2"), "Router weighted has no setting 'depth'"),
    (lambda: make_router("cost:overlap=-1"), "must be a number of at least 0"),
    (lambda: replica_roles(3, 1, 1), "--replicas 3 does not add up"),
    (lambda: replica_roles(1, 2, 0), "needs at least one prefill and one decode"),
    (lambda: replica_roles(0, 0, 0), "--replicas must be from 1 to 256"),
    (lambda: ClusterConfig(staleness_s=-1), "--router-staleness must be at least 0"),
    (lambda: Layout(4).kv_budget_bytes(ModelProfile.load("llama-70b"),
                                       HardwareProfile.load("h100-sxm"), 0.0001),
     "cannot hold llama-70b"),
    (lambda: Layout(3), "tensor_parallel must be one of 1, 2, 4, 8"),
    (lambda: resolve({}, {"executor": "sim", "tensor_parallel": 2, "timing": "fit"},
                     default_executor="sim"), "TP2 is priced by the roofline"),
])
def test_bad_fleet_input_gets_one_sentence(make, match):
    with pytest.raises(ConfigError, match=match) as e:
        make()
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_a_staged_file_with_a_missing_field_is_named(tmp_path):
    bad = tmp_path / "w.toml"
    bad.write_text("[shared_prefix]\nnum_groups = 2\nnum_prompts_per_group = 1\n"
                   "system_prompt_len = 64\noutput_len = 4\n[[stages]]\nrate = 1\n"
                   "duration = 2\n")
    with pytest.raises(TraceError, match="needs question_len as a whole number above 0"):
        load_arrivals(bad)


def test_measured_executors_are_refused():
    settings = resolve({}, {"executor": "torch"}, default_executor="torch")
    with pytest.raises(ConfigError, match="A fleet runs on the sim executor"):
        run_fleet(settings, ["both", "both"], ClusterConfig(), [Arrival(0.0, 8, 1)])


def test_the_router_never_counts_fewer_requests_than_a_replica_holds():
    """Requests sent while a long step runs are not in that step's sample: the router counts
    them from its own books until a step has taken them in."""
    cluster, sessions = fleet(["both"], ClusterConfig(router="least-loaded"))
    arrivals = [Arrival(0.0, 8000, 4)] + [Arrival(0.01 * i, 64, 4) for i in range(1, 30)]
    seen = []
    route = cluster._route

    def watched(i, a, now):
        route(i, a, now)
        e, view = cluster.replicas[0].engine, cluster.replicas[0].view
        there = len(e.scheduler.running) + len(e.scheduler.waiting) + e.inbox.qsize() + \
            len(e.intake.future)
        seen.append((view.queue, there))

    cluster._route = watched
    cluster.run(arrivals)
    assert len(seen) == 30 and all(counted >= there for counted, there in seen), seen
    for s in sessions:
        s.close()

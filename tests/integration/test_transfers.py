"""Transfers between device and host on real executors: swap preemption, prefix demotion
and host hits, weight offload with prefetch — each must leave tokens exactly as they are
without it — and every copy recorded, live and in replay."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.kv_codecs import get_codec
from kvdeck.runtime.executors.paged_kv import PagedKVCache, _raw
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.runs.trace import synthesize_tokens
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.factories import TinySpec, write_tiny_gguf
from tests.integration.test_engine_sim import drive, view_of, workload

SPEC = TinySpec(arch="llama", num_layers=4, head_dim=32, num_heads=2, num_kv_heads=1,
                hidden=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5 + (i * 7 + j) % 80 for j in range(n)] for i, n in enumerate((30, 45, 22, 37))]
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama4.gguf", SPEC)


def torch_engine(path: Path, *, num_blocks: int | None = 400, host_blocks: int = 0,
                 budget_blocks: int = 64, weight_format: str = "dense", **knobs) -> Engine:
    ex = TorchExecutor(path, device="cpu", dtype="fp32", weight_activations="fp32")
    per_block = BLOCK * ex.kv_bytes_per_token("fp16")
    config = EngineConfig(block_size=BLOCK, num_blocks=num_blocks,
                          kv_memory_bytes=budget_blocks * per_block,
                          host_kv_memory_bytes=host_blocks * per_block,
                          knobs=Knobs(max_num_batched_tokens=64, chunk_size=16,
                                      weight_format=weight_format, **knobs))
    return Engine(config, ex)


def run_all(e: Engine, prompts=PROMPTS, prefix: str = "r") -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        e.add_request(p, GREEDY, request_id=f"{prefix}{i}")
    while e.has_work:
        e.step()
        e.check_integrity()
    return {r.request_id: list(r.output_token_ids) for r in e.completed
            if r.request_id.startswith(prefix)}


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[str, list[int]]:
    """Greedy outputs with a pool large enough that nothing is preempted or evicted."""
    return run_all(torch_engine(tiny))


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "q8_0", "q4_0"])
def test_swap_out_then_in_restores_the_exact_kv_bytes(fmt: str) -> None:
    codec = get_codec(fmt, 32, torch.device("cpu"))
    pool = PagedKVCache(3, 12, BLOCK, 2, 32, codec, torch.device("cpu"))
    host = PagedKVCache(3, 6, BLOCK, 2, 32, codec, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for layer in range(3):  # real encoded K/V, not random bytes: q4_0 scales stay finite
        x = torch.randn(12 * BLOCK, 2, 32, generator=gen)
        pool.write(layer, torch.arange(12 * BLOCK), x, -x)
    before = [_raw(t).clone() for layer in pool.k + pool.v for t in layer]
    out = [[2, 0], [7, 1], [11, 2]]
    nbytes = pool.copy_to(host, out)
    assert nbytes == 3 * pool.bytes_per_block
    for layer in pool.k + pool.v:  # the device blocks are reused meanwhile
        for t in layer:
            _raw(t)[[2, 7, 11]] = 0
    host.copy_to(pool, [[0, 2], [1, 7], [2, 11]])
    after = [_raw(t) for layer in pool.k + pool.v for t in layer]
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_swap_preempted_requests_finish_with_the_same_greedy_tokens(
        tiny: Path, reference: dict[str, list[int]]) -> None:
    e = torch_engine(tiny, num_blocks=24, host_blocks=80, preemption="swap")
    outputs = run_all(e)
    assert outputs == reference
    assert e.scheduler.num_swapped > 0 and e.kv.num_swap_ins == e.kv.num_swap_outs
    assert e.kv.host.num_used == e.kv.host.num_demoted  # nothing left swapped
    counters = snapshot_of(e).transfers.counters
    assert counters["d2h_bytes"] > 0 and counters["h2d_bytes"] > 0


def test_auto_preemption_on_the_cpu_also_keeps_tokens(
        tiny: Path, reference: dict[str, list[int]]) -> None:
    e = torch_engine(tiny, num_blocks=24, host_blocks=80, preemption="auto")
    assert run_all(e) == reference
    assert e.scheduler.num_preemptions > 0


def test_swap_needs_a_host_tier(tiny: Path) -> None:
    with pytest.raises(ConfigError, match="preemption swap needs a host KV tier"):
        torch_engine(tiny, preemption="swap")
    e = torch_engine(tiny)
    with pytest.raises(ConfigError, match="needs a host KV tier"):
        e.set_knobs(preemption="auto")


def test_a_demoted_prefix_brought_back_gives_the_same_tokens(tiny: Path) -> None:
    shared = [7 + (j * 5) % 70 for j in range(40)]
    fresh = run_all(torch_engine(tiny), [shared], "a")["a0"]
    e = torch_engine(tiny, num_blocks=32, host_blocks=40)
    first = run_all(e, [shared], "a")["a0"]
    # Other prompts fill the pool: the shared prefix's cached blocks are evicted (LRU:
    # they are the oldest) and demoted to the host instead of dropped.
    run_all(e, [[3 + (i * 11 + j) % 80 for j in range(44)] for i in range(3)], "f")
    tree = e.kv.tree
    assert tree.num_demotions > 0 and e.kv.host.num_demoted > 0
    run_all(e, [shared], "b")
    again = next(r for r in e.completed if r.request_id == "b0")
    assert tree.num_promotions >= 1 and tree.num_host_hit_tokens >= BLOCK
    assert again.num_cached_tokens >= 32  # the prefix came back from the host, not recomputed
    assert first == fresh and list(again.output_token_ids) == fresh
    kinds = {t.kind for s in e.transfer_log.recent for t in s.transfers}
    assert {"demote", "promote"} <= kinds


@pytest.mark.parametrize("weight_format", ["dense", "ffn=int8", "ffn=int4"])
@pytest.mark.parametrize("buffers", [1, 2])
def test_offload_on_and_off_gives_identical_tokens(
        tiny: Path, weight_format: str, buffers: int) -> None:
    plain = run_all(torch_engine(tiny, weight_format=weight_format))
    e = torch_engine(tiny, weight_format=weight_format, offload_layers=3,
                     offload_buffers=buffers)
    assert run_all(e) == plain
    weights = [t for s in e.transfer_log.recent for t in s.transfers if t.kind == "weights"]
    # Every step copies the three offloaded layers' FFN weights, in layer order.
    assert [t.what for t in weights[:3]] == ["layer 1 ffn", "layer 2 ffn", "layer 3 ffn"]
    assert all(t.direction == "h2d" and t.bytes == weights[0].bytes > 0 for t in weights)
    if buffers == 1:
        assert all(t.stall == t.seconds for t in weights)  # copy and compute in series
    else:
        # Two buffers: each copy after the first was started when the layer before began,
        # so compute waited for less than the copies took — the overlap, in the trace.
        assert sum(t.stall for t in weights) < sum(t.seconds for t in weights)


def test_offload_frees_device_memory_for_kv_blocks(tiny: Path) -> None:
    base = torch_engine(tiny, num_blocks=None)
    e = torch_engine(tiny, num_blocks=None, offload_layers=3, offload_buffers=2)
    gain = e.executor.offload_gain_bytes
    assert gain == e.executor.offload.layer_bytes * (3 - 2) > 0
    per_block = e.kv.bytes_per_block
    assert e.kv.num_blocks == (e.config.kv_memory_bytes + gain) // per_block
    assert e.kv.num_blocks > base.kv.num_blocks
    assert e.executor.resident_weight_bytes == base.executor.resident_weight_bytes - gain


def test_offload_switched_mid_run_keeps_tokens_and_resizes_the_pool(
        tiny: Path, reference: dict[str, list[int]]) -> None:
    e = torch_engine(tiny, num_blocks=None, budget_blocks=120)
    for i, p in enumerate(PROMPTS):
        e.add_request(p, GREEDY, request_id=f"r{i}")
    for _ in range(5):
        e.step()
    before = e.kv.num_blocks
    e.set_knobs(offload_layers=4, offload_buffers=1)
    while e.has_work:
        e.step()
        e.check_integrity()
    assert {r.request_id: list(r.output_token_ids) for r in e.completed} == reference
    sw = e.switcher.recent[-1]
    assert sw.knob == "offload_layers" and sw.num_blocks == e.kv.num_blocks > before
    with pytest.raises(ConfigError, match="offload_layers must be from 0 to 4"):
        e.set_knobs(offload_layers=5)


@pytest.mark.cuda
def test_two_buffers_beat_one_on_cuda(tmp_path: Path) -> None:
    """A model whose FFN copies (201 MB per layer in bf16, ~3.7 ms over PCIe Gen5) and FFN
    compute (8K-token prefill steps, 1.65 TFLOP per layer) are of the same order: with two
    buffers each copy hides behind the layer before, so the step is shorter than with one
    (median of several rounds). Small models do not show it: their steps are bound by
    kernel launches, which hide a serialized copy as well."""
    spec = TinySpec(arch="llama", num_layers=4, hidden=2048, num_heads=16, num_kv_heads=4,
                    head_dim=128, ffn=16384, vocab=512, context=4096)
    path = write_tiny_gguf(tmp_path / "wide.gguf", spec)
    prompts = [[(i * 31 + j) % 500 + 1 for j in range(1000)] for i in range(8)]
    times: dict[int, list[float]] = {1: [], 2: []}
    stalls: dict[int, list[float]] = {1: [], 2: []}
    engines = {}
    for buffers in (1, 2):
        ex = TorchExecutor(path, device="cuda", dtype="bf16")
        engines[buffers] = Engine(EngineConfig(block_size=16, num_blocks=1024, knobs=Knobs(
            offload_layers=3, offload_buffers=buffers, max_num_batched_tokens=8192,
            chunk_size=1024, enable_prefix_caching=False)), ex)
    for round_ in range(4):  # interleaved, the first round a warm-up
        for buffers, e in engines.items():
            for i, p in enumerate(prompts):
                e.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                              request_id=f"{round_}-{i}")
            while e.has_work:
                rec = e.step()
                if round_ and rec is not None and rec.dt and rec.num_prefill >= 4096:
                    times[buffers].append(rec.dt)
                    weights = [t for t in rec.transfers if t.kind == "weights"]
                    assert len(weights) == 3 and all(t.bytes > 200e6 for t in weights)
                    stalls[buffers].append(sum(t.stall for t in weights))
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"median prefill step: one buffer {one * 1e3:.2f} ms, two {two * 1e3:.2f} ms; "
          f"compute waited {statistics.median(stalls[1]) * 1e3:.2f} ms and "
          f"{statistics.median(stalls[2]) * 1e3:.2f} ms for the copies")
    assert two < one


@pytest.mark.cuda
def test_swap_demotion_and_offload_keep_tokens_on_cuda(tiny: Path) -> None:
    def engine(**kw) -> Engine:
        ex = TorchExecutor(tiny, device="cuda", dtype="fp32")
        per_block = BLOCK * ex.kv_bytes_per_token("fp16")
        return Engine(EngineConfig(block_size=BLOCK, num_blocks=kw.pop("num_blocks", 400),
                                   host_kv_memory_bytes=80 * per_block,
                                   knobs=Knobs(max_num_batched_tokens=64, chunk_size=16,
                                               **kw)), ex)
    reference = run_all(engine())
    swapped = engine(num_blocks=24, preemption="swap")
    assert run_all(swapped) == reference
    assert swapped.scheduler.num_swapped > 0 and swapped.kv.num_swap_ins > 0
    assert swapped.executor.host_kv.k[0][0].is_pinned()
    assert "cuda" in swapped.executor.info.link_detail  # measured over pinned host memory
    assert swapped.executor.info.link_detail.endswith("pinned")
    for buffers in (1, 2):
        assert run_all(engine(offload_layers=3, offload_buffers=buffers)) == reference


# -- the sim: priced transfers, recorded and replayed ----------------------------------------

def test_sim_swaps_demotes_offloads_and_replays_every_step(tmp_path: Path) -> None:
    ex = SimExecutor(SimConfig(eos_probability=0.02), seed=7)
    per_block = 8 * ex.kv_bytes_per_token("fp16")
    e = Engine(EngineConfig(block_size=8, kv_memory_bytes=60 * per_block,
                            host_kv_memory_bytes=40 * per_block, seed=7,
                            knobs=Knobs(max_num_batched_tokens=512, chunk_size=128,
                                        max_num_seqs=16, preemption="swap")), ex)
    rec = record_headless(e, tmp_path)
    for i, a in enumerate(workload()):
        e.add_request(synthesize_tokens(a, i, 32_000), SamplingParams(max_tokens=a.output_len),
                      request_id=f"r{i}", arrival_time=a.arrival_s)
    live: list[tuple[dict, object]] = []

    def go(n: int) -> None:
        views: list[dict] = []
        drive(e, n, views)
        live.extend((v, None) for v in views[:-1])
        if views:  # at the end of each phase, the transfers view is compared as well
            live.append((views[-1], snapshot_of(e).transfers))

    go(25)
    e.set_knobs(offload_layers=8, offload_buffers=2)
    go(25)
    e.set_knobs(preemption="auto", eviction_policy="value")
    go(25)
    e.set_knobs(kv_format="q8_0")  # re-lays the pool: the host tier is emptied
    go(100_000)
    rec.close()
    e.check_integrity()
    assert len(e.completed) == 40
    assert {r.status for r in e.completed} <= {RequestStatus.FINISHED_STOPPED,
                                                RequestStatus.FINISHED_LENGTH}
    c = snapshot_of(e).transfers.counters
    assert e.scheduler.num_swapped > 0 and c["swap_ins"] > 0
    assert c["demotions"] > 0 and c["weight_bytes"] > 0
    replay = Replay(*read_run(tmp_path))
    state = replay.initial_state()
    assert len(replay.steps) == len(live)
    kinds = set()
    for step, (record, (expected, transfers)) in enumerate(zip(replay.steps, live,
                                                               strict=True)):
        state.apply(record)
        state.check_integrity()
        kinds |= {ev.kind for ev in record.kv} | {t.kind for t in record.transfers}
        got = state.snapshot()
        for key, value in view_of(got).items():
            assert value == expected[key], f"{key} differs after record {step}"
        if transfers is not None:  # the host tier and what crossed the link agree too
            t = got.transfers
            assert (t.host_states, t.swapped_requests, t.last) == \
                (transfers.host_states, transfers.swapped_requests, transfers.last)
            assert t.counters == transfers.counters
    assert {"swap_out", "swap_in", "demote", "swap", "weights", "host_resize"} <= kinds

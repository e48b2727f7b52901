"""The sim executor against the reference measurements in docs/architecture.md, and at
datacenter scale."""

from __future__ import annotations

import tracemalloc

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.views.snapshot import snapshot_of

# vLLM on the RTX PRO 6000, Qwen3-8B BF16, 2K context: decode step by batch size.
MEASURED_DECODE_MS = {1: 26.26, 4: 26.62, 16: 27.44, 64: 29.63}


# The bytes those steps read and so their MBU at 1.792 TB/s (the chapter's table).
MEASURED_MBU = {1: 0.33, 4: 0.34, 16: 0.41, 64: 0.65}


@pytest.mark.parametrize("timing, rel", [("measured", 1e-9), ("fit", 0.04)])
@pytest.mark.parametrize("batch, measured", MEASURED_DECODE_MS.items())
def test_the_step_models_reproduce_measured_decode_steps(batch: int, measured: float,
                                                         timing: str, rel: float) -> None:
    sim = SimExecutor(SimConfig(timing=timing))
    ms = 1e3 * sim.estimate_step_seconds(batch, batch * causal_pairs(1, 2048), batch * 2048)
    assert ms == pytest.approx(measured, rel=rel)


@pytest.mark.parametrize("batch", MEASURED_MBU)
def test_a_simulated_step_reads_and_takes_what_the_card_measured(batch: int) -> None:
    """The sim's own step record (bytes read, time) gives the chapter's MBU table: the
    figures a roofline readout divides."""
    engine = Engine(EngineConfig(kv_memory_bytes=40 * 2**30, knobs=Knobs(
        max_num_batched_tokens=8192, chunk_size=8192, max_num_seqs=64,
        enable_prefix_caching=False)), SimExecutor())
    for i in range(batch):
        engine.add_request([3 + (i * 7 + j) % 30_000 for j in range(2047)],
                           SamplingParams(max_tokens=64, ignore_eos=True))
    engine.step()
    while any(not r.is_decoding for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    record = engine.step()  # one decode step: every row reads about 2,048 positions
    assert len(record.plan) == batch
    assert all(e.num_new_tokens == 1 and 2047 <= e.start < 2070 for e in record.plan)
    hw = engine.executor.hardware
    assert record.bytes_read / record.dt / hw.bandwidth_bytes_per_s == pytest.approx(
        MEASURED_MBU[batch], abs=0.005)
    assert record.dt * 1e3 == pytest.approx(MEASURED_DECODE_MS[batch], rel=2e-3)
    # The console's roofline readout is that record against the card's peaks.
    roof = snapshot_of(engine).roofline
    assert (roof.step, roof.seconds, roof.bytes_read) == (record.step, record.dt,
                                                          record.bytes_read)
    mbu, mfu = roof.utilisation()
    assert mbu == pytest.approx(MEASURED_MBU[batch], abs=0.005)
    assert roof.floor_s == pytest.approx(record.bytes_read / hw.bandwidth_bytes_per_s)
    assert roof.gap_s == pytest.approx(record.dt - roof.floor_s) and mfu < 0.1
    # A fixed cost dominates small batches (CUDA graphs off); batch 64 is read-bound.
    assert roof.bound == ("memory" if batch == 64 else "overhead")
    engine.check_integrity()


def test_the_step_models_price_a_2k_prefill_and_profile_facts() -> None:
    # The fit reproduces the batch-1 2K prefill (MFU 62 %); the measured model prices
    # prefill at the one measured efficiency it has (58 %, batch 16 of 8K on 6K cached),
    # so its batch-1 figure is that much slower: 94.8 × 62 / 58.
    fit = SimExecutor(SimConfig(timing="fit"))
    assert 1e3 * fit.estimate_step_seconds(2048, causal_pairs(2048, 0), 2048) == \
        pytest.approx(94.8, rel=0.01)
    measured = SimExecutor()
    assert 1e3 * measured.estimate_step_seconds(2048, causal_pairs(2048, 0), 2048) == \
        pytest.approx(94.8 * 0.62 / 0.58, rel=0.02)
    model, hw = ModelProfile.load("qwen3-8b"), HardwareProfile.load("rtx-pro-6000")
    assert model.kv_bytes_per_token() == 147_456
    assert hw.memory_bytes == 96_000_000_000 and hw.bandwidth_bytes_per_s == 1.792e12


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_prefill() -> None:
    sim = SimExecutor(SimConfig(timing="roofline"))
    m, hw = sim.model, sim.hardware
    decode = sim.estimate_step_seconds(1, causal_pairs(1, 2048), 2049)
    assert decode == pytest.approx((m.matrix_weight_bytes + 2049 * 147_456)
                                   / (hw.bandwidth_bytes_per_s * hw.mbu))
    prefill = sim.estimate_step_seconds(4096, causal_pairs(4096, 0), 4096)
    flops = 2 * m.matrix_params * 4096 + 4 * causal_pairs(4096, 0) * 32 * 128 * 36
    assert prefill == pytest.approx(flops / (hw.peak_flops * hw.mfu))


@pytest.mark.slow
def test_8b_on_96_gb_with_hundreds_of_8k_requests() -> None:
    """The long-context workload (8192 in, first 6144 shared, 256 out) at datacenter scale:
    the KV pool is ~79 GB of accounting, not memory."""
    model = ModelProfile.load("qwen3-8b")
    budget = 96_000_000_000 - model.weight_bytes
    engine = Engine(EngineConfig(kv_memory_bytes=budget,
                                 knobs=Knobs(max_num_batched_tokens=8192, chunk_size=8192)),
                    SimExecutor())
    arrivals = [Arrival(0.05 * i, 8192, 256, prefix_group="tools", prefix_len=6144,
                        deadline_s=7.0) for i in range(300)]
    tracemalloc.start()
    result = run_arrivals(engine, arrivals, vocab_size=32_000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    engine.check_integrity()
    s = result["summary"]
    assert engine.kv.num_blocks == budget // (16 * 147_456)  # 33,229 blocks, ~79.6 GB
    assert s["statuses"] == {"finished_length": 300}
    assert s["prefix_hit_rate"] > 0.7  # 6144 of 8191 reusable tokens, after the first
    assert peak < 600 * 2**20  # tokens and bookkeeping only


def test_auto_timing_falls_back_as_the_planner_does() -> None:
    # Qwen3-8B has measured steps and a fit on the reference card, neither on an H200.
    assert SimExecutor().timing == "measured"
    assert SimExecutor(SimConfig(fixed_ms=20.0, per_token_us=30.0, per_pair_ns=3.0)
                       ).timing == "fit"  # given values: the fit they make
    assert SimExecutor(SimConfig(hardware="h200")).timing == "roofline"


def test_execution_shapes_pad_a_step_and_price_the_padding() -> None:
    from kvdeck.runtime.errors import ConfigError
    from kvdeck.runtime.planning.step_time import padded_rows, parse_buckets

    assert parse_buckets("32,16") == (16, 32) and parse_buckets("") == ()
    assert [padded_rows(n, (16, 32)) for n in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 33]
    with pytest.raises(ConfigError, match="graph_buckets must be comma-separated row counts"):
        SimConfig(graph_buckets="16,x")
    plain = SimExecutor(SimConfig(timing="fit"))
    shaped = SimExecutor(SimConfig(timing="fit", graph_buckets="16,32"))
    # 17 decode rows run as 32: 15 more rows at the fit's 30.4 µs each.
    extra = shaped.estimate_step_seconds(17, 17 * 2049, 17 * 2049) - \
        plain.estimate_step_seconds(17, 17 * 2049, 17 * 2049)
    assert extra == pytest.approx(15 * 30.4e-6)
    engine = Engine(EngineConfig(kv_memory_bytes=1 << 30, knobs=Knobs(
        enable_prefix_caching=False)), SimExecutor(SimConfig(graph_buckets="16,32")))
    for i in range(17):
        engine.add_request([3 + i] * 16, SamplingParams(max_tokens=4, ignore_eos=True))
    records = [r for r in (engine.step() for _ in range(6)) if r is not None and r.dt]
    decode = records[-1]
    assert decode.num_decode == 17 and decode.padding == 15
    assert decode.dt == pytest.approx(decode.predicted_s)  # the scheduler priced it so
    assert snapshot_of(engine).batch.padding == 15
    assert engine.figures.waste.wasted["padding"] == sum(r.padding for r in records)
    engine.check_integrity()

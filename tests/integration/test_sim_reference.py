"""The sim executor against the reference measurements in docs/architecture.md, and at
datacenter scale."""

from __future__ import annotations

import tracemalloc

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival

# vLLM on the RTX PRO 6000, Qwen3-8B BF16, 2K context: decode step by batch size.
MEASURED_DECODE_MS = {1: 26.26, 4: 26.62, 16: 27.44, 64: 29.63}


@pytest.mark.parametrize("batch, measured", MEASURED_DECODE_MS.items())
def test_fit_reproduces_measured_decode_steps(batch: int, measured: float) -> None:
    sim = SimExecutor()
    ms = 1e3 * sim.estimate_step_seconds(batch, batch * causal_pairs(1, 2048), batch * 2049)
    assert ms == pytest.approx(measured, rel=0.04)


def test_fit_reproduces_2k_prefill_and_profile_facts() -> None:
    sim = SimExecutor()
    assert 1e3 * sim.estimate_step_seconds(2048, causal_pairs(2048, 0), 2048) == \
        pytest.approx(94.8, rel=0.01)
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

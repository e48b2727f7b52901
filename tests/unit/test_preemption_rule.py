"""`auto` preemption's rule on the reference card (Qwen3-8B, BF16 KV, RTX PRO 6000, PCIe
Gen5 x16): swap when copying the victim's blocks out and back, `2 · bytes / link`, is
faster than recomputing its tokens — the time they add to a step. Numbers worked by hand.

    KV per token     36 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes = 147,456 B
    per block (16)   2,359,296 B; over 64 GB/s one way: 36.864 µs, so 73.728 µs out and back
"""

from __future__ import annotations

import pytest

from kvdeck.runtime.core.policies.preemption import swap_or_recompute
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor

BLOCK = 16


def rule(timing: str, num_tokens: int) -> tuple[str, float, float]:
    sim = SimExecutor(SimConfig(timing=timing))
    assert sim.kv_bytes_per_token("bf16") == 147_456
    assert sim.info.link_bandwidth == 64e9
    return swap_or_recompute(num_tokens, BLOCK, 147_456 * BLOCK,
                             lambda nbytes: nbytes / sim.info.link_bandwidth,
                             sim.estimate_step_seconds)


def test_fitted_step_model_swaps_a_long_context_and_recomputes_a_few_tokens() -> None:
    # Fit: 30.4 µs per new token + 3 ns per causal pair (the fixed 26.22 ms per step is not
    # the recompute's own: it rides in steps that run anyway).
    choice, swap, recompute = rule("fit", 2)
    # 2 tokens: one whole block each way, 73.728 µs; recompute 2 × 30.4 µs + 3 pairs × 3 ns.
    assert swap == pytest.approx(73.728e-6)
    assert recompute == pytest.approx(60.809e-6)
    assert choice == "recompute"
    choice, swap, recompute = rule("fit", 2000)
    # 2,000 tokens = 125 blocks: 9.216 ms out and back; recompute 60.8 ms + 2,001,000 pairs
    # × 3 ns = 66.803 ms.
    assert swap == pytest.approx(9.216e-3)
    assert recompute == pytest.approx(66.803e-3)
    assert choice == "swap"


def test_roofline_recompute_of_a_short_context_is_nearly_free() -> None:
    # Roofline: a step reads 15.14 GB of weights at 1.792 TB/s × 0.65 = 12.995 ms; 100 new
    # tokens need 2 × 7.568e9 × 100 + attention ≈ 1.517 TFLOP, 4.9 ms at 503.8 TFLOP/s ×
    # 0.61: still memory-bound, so recomputing them costs only their KV reads,
    # 100 × 147,456 B / 1.1648 TB/s = 12.66 µs — against 7 blocks out and back, 516.1 µs.
    choice, swap, recompute = rule("roofline", 100)
    assert swap == pytest.approx(7 * 73.728e-6)
    assert recompute == pytest.approx(100 * 147_456 / 1164.8e9, rel=1e-3)
    assert choice == "recompute"
    # 4,000 tokens: 6.06e13 + 4.70e12 FLOP ≈ 0.2125 s of compute, minus the 13 ms step it
    # rides in; 250 blocks out and back take 18.43 ms.
    choice, swap, recompute = rule("roofline", 4000)
    assert swap == pytest.approx(250 * 73.728e-6)
    assert recompute == pytest.approx(0.2125 - 0.013, rel=0.01)
    assert choice == "swap"

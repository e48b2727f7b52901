"""Tensor parallelism's all-reduces in the step model (`runtime/planning/parallel.py`); the
chapter's worked example is the `tp-allreduce` scenario (`tests/unit/test_scenarios.py`)."""

from __future__ import annotations

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.parallel import (
    allreduce_seconds_per_layer,
    allreduce_seconds_per_step,
    layer_message_bytes,
    ring_allreduce_seconds,
)
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile


def test_a_ring_moves_2_n_minus_1_over_n_of_the_message() -> None:
    assert ring_allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)
    assert ring_allreduce_seconds(1e9, 4, 1e9) == pytest.approx(1.5)
    assert ring_allreduce_seconds(1e9, 1, 1e9) == 0.0
    with pytest.raises(ConfigError, match="link bandwidth above 0"):
        ring_allreduce_seconds(1e9, 2, 0.0)


def test_layers_reduce_their_activations_twice_over_the_cards_interconnect() -> None:
    model = ModelProfile.load("llama-70b")
    nvlink, pcie = HardwareProfile.load("h100-sxm"), HardwareProfile.load("a100-80gb-pcie")
    assert nvlink.interconnect_bandwidth_bytes_per_s == 900e9
    # No [interconnect]: card to card over the host link (PCIe Gen4 x16).
    assert pcie.interconnect_bandwidth_bytes_per_s == pcie.link_bandwidth_bytes_per_s == 32e9
    assert layer_message_bytes(model, 1) == 8192 * 2
    one = allreduce_seconds_per_layer(model, 1000, 2, nvlink)
    assert one == pytest.approx(2 * 1000 * 8192 * 2 / 900e9)
    assert allreduce_seconds_per_step(model, 1000, 2, nvlink) == pytest.approx(80 * one)
    assert allreduce_seconds_per_layer(model, 1000, 1, nvlink) == 0.0
    assert allreduce_seconds_per_layer(model, 1000, 4, pcie) == pytest.approx(
        2 * 1.5 * 1000 * 8192 * 2 / 32e9)

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


def test_a_layout_splits_a_step_across_its_cards_and_pays_its_bubbles():
    from kvdeck.runtime.planning.parallel import Layout, layout_step_seconds
    from kvdeck.runtime.planning.step_time import roofline_seconds

    model, hw = ModelProfile.load("llama-70b"), HardwareProfile.load("h100-sxm")
    k = model.kv_bytes_per_token()
    w = model.matrix_weight_bytes
    one = roofline_seconds(model, hw, w, k, 64, 64 * 4096, 64 * 4096)
    assert layout_step_seconds(model, hw, Layout(), w, k, 64, 64 * 4096, 64 * 4096) == \
        pytest.approx(one)
    tp2 = layout_step_seconds(model, hw, Layout(2), w, k, 64, 64 * 4096, 64 * 4096)
    allreduce = allreduce_seconds_per_step(model, 64, 2, hw)
    assert tp2 == pytest.approx(one / 2 + allreduce)
    # Two stages, two microbatches: three stage times, each re-reading its half of the
    # weights; the bubble is a third.
    pp2 = layout_step_seconds(model, hw, Layout(1, 2), w, k, 64, 64 * 4096, 64 * 4096)
    assert pp2 > one and Layout(1, 2).bubble() == pytest.approx(1 / 3)
    assert Layout(4, 2).cards == 8 and Layout(4, 2).name == "TP4×PP2"


def test_a_single_row_runs_the_pipeline_as_one_microbatch():
    from kvdeck.runtime.planning.parallel import Layout, layout_step_seconds

    model, hw = ModelProfile.load("llama-70b"), HardwareProfile.load("h100-sxm")
    k, w = model.kv_bytes_per_token(), model.matrix_weight_bytes
    one = layout_step_seconds(model, hw, Layout(), w, k, 1, 4096, 4096)
    pp2 = layout_step_seconds(model, hw, Layout(1, 2), w, k, 1, 4096, 4096)
    # Two stages in turn, each reading half the weights once: one card's time, plus the
    # activations' hop between them.
    assert one <= pp2 < one * 1.01

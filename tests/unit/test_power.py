"""Accelerator power from NVML: a plausible limit and draw on an NVIDIA GPU; nothing (not a
crash) without one."""

from __future__ import annotations

import pytest
import torch

from kvdeck.runtime.planning.power import nvml_power


@pytest.mark.cuda
def test_nvml_gives_a_plausible_limit_and_draw() -> None:
    reading = nvml_power(0)
    assert reading is not None
    assert 10 < reading.limit_w < 2000 and 0 < reading.draw_w <= reading.limit_w * 1.2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_there_is_no_reading() -> None:
    assert nvml_power(0) is None

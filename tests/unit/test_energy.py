"""Energy from the machine's counters (`runtime/stats/energy.py`): RAPL package counters read
as the kernel lays them out (a powercap folder of zones, each `energy_uj` and
`max_energy_range_uj`), a counter that wraps, unreadable zones, and the sentence where
nothing is readable; the sim's modelled energy in run summaries."""

from __future__ import annotations

import pytest
import torch

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.executors.sim import SimExecutor
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.stats.energy import EnergyMeter
from kvdeck.runtime.views.snapshot import snapshot_of


def zone(root, name: str, energy: int, most: int = 1_000_000):
    z = root / name
    z.mkdir(parents=True)
    (z / "energy_uj").write_text(f"{energy}\n")
    (z / "max_energy_range_uj").write_text(f"{most}\n")
    return z


def test_rapl_packages_are_summed_and_a_wrapping_counter_unwrapped(tmp_path) -> None:
    a = zone(tmp_path, "intel-rapl:0", 900_000)
    b = zone(tmp_path, "intel-rapl:1", 10)
    zone(tmp_path, "intel-rapl:0:0", 5)  # a sub-zone (core): counted in its package
    meter = EnergyMeter.probe(tmp_path)
    if meter.source.startswith("NVML"):
        pytest.skip("this machine has NVIDIA GPUs: their counters are summed in too")
    assert meter.readable and meter.source == "RAPL (2 packages)"
    assert meter.joules() == 0.0
    (a / "energy_uj").write_text("50000\n")  # wrapped past 1,000,000: +150,000 µJ
    (b / "energy_uj").write_text("2000010\n")
    assert meter.joules() == pytest.approx(0.15 + 2.0)


def test_nothing_readable_is_said_not_guessed(tmp_path) -> None:
    meter = EnergyMeter.probe(tmp_path / "absent")
    if meter.readable:
        pytest.skip("this machine has NVIDIA GPUs with an energy counter")
    assert meter.source == "not readable here: no NVML energy counter, and no RAPL files"
    assert meter.joules() is None
    z = zone(tmp_path, "intel-rapl:0", 1)
    (z / "max_energy_range_uj").write_text("not a number")
    assert EnergyMeter.probe(tmp_path).source == (
        "not readable here: no NVML energy counter, and the RAPL files are not readable")


def test_a_sim_run_models_its_energy_at_the_card_s_power_limit() -> None:
    engine = Engine(EngineConfig(kv_memory_bytes=4 << 30), SimExecutor())
    s = run_arrivals(engine, [Arrival(0.0, 512, 16) for _ in range(4)],
                     vocab_size=32_000)["summary"]
    energy = s["energy"]
    assert energy["source"] == "modelled: busy time at rtx-pro-6000's 600 W limit"
    assert energy["joules"] == pytest.approx(s["steps"]["busy_s"] * 600)
    assert energy["joules_per_good"] == pytest.approx(energy["joules"] / s["num_good"])
    # The console shows the same figures live (the snapshot's `energy`).
    assert snapshot_of(engine).energy == energy


def test_a_real_executor_s_snapshot_says_what_it_can_read(tiny_llama) -> None:
    from kvdeck.runtime.executors.torch import TorchExecutor

    engine = Engine(EngineConfig(kv_memory_bytes=4 << 20),
                    TorchExecutor(tiny_llama, device="cpu", dtype="fp32"))
    energy = snapshot_of(engine).energy
    meter = EnergyMeter.probe()
    if meter.readable:
        assert energy["joules"] is not None and energy["source"].endswith("first snapshot")
    else:  # this machine: no NVML counter, no readable RAPL files — said, never made up
        assert energy["joules"] is None and energy["source"] == meter.source
    engine.close()


@pytest.mark.cuda
def test_nvml_counts_the_energy_of_gpu_work(tmp_path) -> None:
    """On an NVIDIA GPU the meter reads NVML's counter: a second of matrix products adds
    joules, no more than the cards' power limit allows in that time."""
    import time

    from kvdeck.runtime.planning.power import nvml_power

    meter = EnergyMeter.probe(tmp_path)  # no RAPL files here: NVML alone
    assert meter.readable and meter.source.startswith("NVML")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, t0 = meter.joules(), time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ a
    torch.cuda.synchronize()
    joules, seconds = meter.joules() - start, time.perf_counter() - t0
    limit = nvml_power(0).limit_w * torch.cuda.device_count()
    assert 0 < joules <= limit * seconds * 1.2

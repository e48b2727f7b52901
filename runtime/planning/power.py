"""Accelerator power from NVML, where there is one: the enforced power limit (what the planner
prices energy at by default) and the draw now (what a live plan prices it at)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PowerReading:
    limit_w: float
    draw_w: float


def nvml_power(index: int = 0) -> PowerReading | None:
    """GPU `index`'s power limit and draw in watts, or None without NVML (no NVIDIA GPU,
    no driver, or no `pynvml`)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            return PowerReading(pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                                pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None

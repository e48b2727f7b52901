"""Hardware strip: kvdeck's own CPU and resident memory and the machine's CPU and memory
(psutil), GPU utilization, memory and power (NVML); on Apple silicon, whose GPU shares the
machine's memory, the engine's resident weights and KV against that memory instead. Each
reader that is missing says so instead of failing."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable

import psutil
from textual.widgets import Static


def _nvml_line() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        power = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
        return f"GPU {util}% · {mem.used / 2**30:.1f}/{mem.total / 2**30:.0f} GiB · {power:.0f} W"
    except Exception:  # noqa: BLE001 - no driver, no GPU, no library: all mean "no reading"
        return "GPU: no NVML reading"


def unified_memory() -> bool:
    """Apple silicon: CPU and GPU (Metal) share one memory."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def unified_line(weights_bytes: int, kv_bytes: int, total_bytes: int) -> str:
    """Resident weights and KV pool against a unified memory's size."""
    gib = 2**30
    used = weights_bytes + kv_bytes
    return (f"unified memory: weights {weights_bytes / gib:.2f} + KV {kv_bytes / gib:.2f} = "
            f"{used / gib:.2f} of {total_bytes / gib:.0f} GiB ({100 * used / total_bytes:.1f}%)")


class HardwareStrip(Static):
    """One line of machine readings, refreshed by the app (or off, for snapshots)."""

    DEFAULT_CSS = "HardwareStrip { height: 1; padding: 0 1; background: $panel; }"

    def __init__(self, enabled: bool = True,
                 resident: Callable[[], tuple[int, int]] | None = None, **kwargs) -> None:
        """`resident`: the engine's (weights bytes, KV pool bytes), shown against unified
        memory on Apple silicon."""
        super().__init__(**kwargs)
        self.enabled = enabled
        self.resident = resident
        self.process = psutil.Process()
        self.process.cpu_percent()  # the first reading starts the interval

    def refresh_readings(self) -> None:
        if not self.enabled:
            self.update("hardware readings off")
            return
        mem = psutil.virtual_memory()
        proc = self.process
        # kvdeck's own share: CPU over all cores (100% = one core busy) and resident memory.
        rss = proc.memory_info().rss
        rss_text = f"{rss / 2**20:,.0f} MiB" if rss < 2**30 else f"{rss / 2**30:.2f} GiB"
        self.update(f"kvdeck CPU {proc.cpu_percent():.0f}% · RSS {rss_text} │ machine CPU "
                    f"{psutil.cpu_percent():.0f}% · RAM {mem.used / 2**30:.1f}/"
                    f"{mem.total / 2**30:.0f} GiB · {self._device_line(mem.total)}")

    def _device_line(self, total: int) -> str:
        if unified_memory() and self.resident is not None:
            return unified_line(*self.resident(), total)
        return _nvml_line()

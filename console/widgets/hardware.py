"""Hardware strip: kvdeck's own CPU and resident memory and the machine's CPU and memory
(psutil), GPU utilization, memory and power (NVML); each reader that is missing says so
instead of failing."""

from __future__ import annotations

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


class HardwareStrip(Static):
    """One line of machine readings, refreshed by the app (or off, for snapshots)."""

    DEFAULT_CSS = "HardwareStrip { height: 1; padding: 0 1; background: $panel; }"

    def __init__(self, enabled: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.enabled = enabled
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
                    f"{mem.total / 2**30:.0f} GiB · {_nvml_line()}")

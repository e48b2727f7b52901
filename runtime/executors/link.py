"""The device↔host link's bandwidth, measured at start-up.

On CUDA: copies of a 64 MiB pinned host buffer to the device and back, timed with a
synchronize (PCIe or NVLink-C2C, per direction). On the CPU, "device" and "host" are the same
memory and a transfer is a memcpy between two buffers: its bandwidth is what swaps,
demotions and weight prefetches there cost. The best of a few repetitions is kept (a shared
machine's noise only ever slows a copy down).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SIZE = 64 << 20
REPEATS = 3


@dataclass(frozen=True)
class LinkSpeed:
    """Measured copy bandwidth, bytes per second, each way."""

    h2d: float
    d2h: float
    what: str
    """How it was measured, e.g. `memcpy (CPU)` or `cuda:0 pinned`."""

    @property
    def bandwidth(self) -> float:
        """The slower direction: what a round trip is bounded by."""
        return min(self.h2d, self.d2h)

    def describe(self) -> str:
        return f"{self.h2d / 1e9:.1f}/{self.d2h / 1e9:.1f} GB/s in/out, {self.what}"


def _best(copy, sync, nbytes: int) -> float:
    copy()  # warm-up: first-touch page faults are not the link's cost
    sync()
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        copy()
        sync()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_link(device: torch.device, size: int = SIZE) -> LinkSpeed:
    """Measure the host link of `device` (about a tenth of a second)."""
    n = size // 4
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.float32).pin_memory()
        dev = torch.empty(n, dtype=torch.float32, device=device)

        def sync() -> None:
            torch.cuda.synchronize(device)
        h2d = _best(lambda: dev.copy_(host, non_blocking=True), sync, n * 4)
        d2h = _best(lambda: host.copy_(dev, non_blocking=True), sync, n * 4)
        return LinkSpeed(h2d, d2h, f"{device} pinned")
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    speed = _best(lambda: b.copy_(a), lambda: None, n * 4)
    return LinkSpeed(speed, speed, f"memcpy ({device.type})")

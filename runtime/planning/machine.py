"""The hardware measurement: this machine's read bandwidth and matmul rate, and the name its
calibrated profile goes by. Nothing here reads a profile (`profiles.py` builds the `local`
hardware profile from these numbers)."""

from __future__ import annotations

import os
import time


def measure_machine(device: str = "cpu") -> tuple[float, float]:
    """(read bandwidth in bytes/s, matmul FLOP/s) on `device`, best of 5 each.

    Bandwidth: a 512 MiB fp32 matrix–vector product (memory-bound). Compute: a 2048³
    matrix product (compute-bound), fp32 on the CPU, bf16 on a GPU (the dense BF16 peak
    datasheets quote)."""
    import torch

    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    m, v = torch.randn(8192, 16384, device=dev), torch.randn(16384, device=dev)
    a, b = (torch.randn(2048, 2048, device=dev, dtype=dtype) for _ in range(2))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    best_mv = best_mm = float("inf")
    for _ in range(5):
        sync()
        t = time.perf_counter()
        m @ v
        sync()
        best_mv = min(best_mv, time.perf_counter() - t)
        t = time.perf_counter()
        a @ b
        sync()
        best_mm = min(best_mm, time.perf_counter() - t)
    return m.numel() * 4 / best_mv, 2 * 2048 ** 3 / best_mm


def local_name(device: str = "cpu") -> str:
    """This machine's hardware profile name: `local-cpu-<cores>c` or `local-<gpu name>`."""
    if device.startswith("cuda"):
        import torch

        return "local-" + torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return f"local-cpu-{os.cpu_count()}c"

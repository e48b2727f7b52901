"""Energy as the machine counts it: NVIDIA GPUs' total-energy counter (NVML, millijoules
since the driver loaded) and Linux's powercap RAPL package counters (microjoules, wrapping
at `max_energy_range_uj`). `EnergyMeter.probe()` finds what this machine lets kvdeck read;
`joules()` is the energy used since it started. Where neither exists it says so — a figure
is never made up (the sim's modelled energy is the planner's, at the profile's power)."""

from __future__ import annotations

from pathlib import Path

POWERCAP = Path("/sys/class/powercap")


class _Rapl:
    """One RAPL package zone's counter, unwrapped."""

    def __init__(self, zone: Path):
        self.energy = zone / "energy_uj"
        self.range = int((zone / "max_energy_range_uj").read_text())
        self.last = int(self.energy.read_text())
        self.total = 0

    def read(self) -> float:
        now = int(self.energy.read_text())
        self.total += now - self.last if now >= self.last else now + self.range - self.last
        self.last = now
        return self.total / 1e6


class _Nvml:
    """Every NVIDIA GPU's total-energy counter."""

    def __init__(self, pynvml):
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
        self.start = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]

    def read(self) -> float:
        now = [self.nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]
        return sum(b - a for a, b in zip(self.start, now, strict=True)) / 1e3


def energy_figures(joules: float | None, source: str, num_good: int) -> dict:
    """A run summary's `energy`: joules, joules per good result, and where they come from."""
    per_good = joules / num_good if joules is not None and num_good else None
    return {"source": source, "joules": joules, "joules_per_good": per_good}


def modelled_energy(busy_s: float, card: str, watts: float, num_good: int) -> dict:
    """The sim's energy: its busy time at the card profile's power limit (an upper bound,
    as the planner prices it), or no figure where the profile has no power."""
    if not watts:
        return energy_figures(None, "not measured: simulated time, and no power figure",
                              num_good)
    return energy_figures(busy_s * watts, f"modelled: busy time at {card}'s {watts:g} W "
                                          "limit", num_good)


class EnergyMeter:
    """The energy counters this machine exposes, read together (see the module docstring).
    `source` names them, or says why there are none."""

    def __init__(self, counters: list, source: str):
        self.counters, self.source = counters, source

    @classmethod
    def probe(cls, powercap: Path = POWERCAP) -> EnergyMeter:
        counters, names = [], []
        try:
            import pynvml

            pynvml.nvmlInit()
            nvml = _Nvml(pynvml)
            if nvml.handles:
                counters.append(nvml)
                names.append(f"NVML ({len(nvml.handles)} GPU)")
        except Exception:  # noqa: BLE001 - no library, no driver, no GPU, no counter
            pass
        zones = sorted(z for z in powercap.glob("intel-rapl:*") if z.name.count(":") == 1) \
            if powercap.is_dir() else []
        readable = []
        for zone in zones:
            try:
                readable.append(_Rapl(zone))
            except (OSError, ValueError):  # root-only since 2020 on most distributions
                continue
        if readable:
            counters.extend(readable)
            names.append(f"RAPL ({len(readable)} package{'s' * (len(readable) > 1)})")
        if not counters:
            why = "no NVML energy counter" + (
                ", and the RAPL files are not readable" if zones else ", and no RAPL files")
            return cls([], f"not readable here: {why}")
        return cls(counters, " + ".join(names))

    @property
    def readable(self) -> bool:
        return bool(self.counters)

    def joules(self) -> float | None:
        """Energy since the meter started (None where nothing is readable)."""
        if not self.counters:
            return None
        return sum(c.read() for c in self.counters)

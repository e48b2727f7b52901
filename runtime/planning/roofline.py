"""One executed step against the machine's roofline: what it read and computed, the floor
those set at the machine's peak bandwidth and compute, the time it took, MBU and MFU, the
gap between the two, and which limit bound it (docs/architecture.md, "The roofline
readout"). The bytes are the executor's own `bytes_read`; the FLOPs follow the step's plan
(`2·matrix_params` per new token and attention over its causal pairs), as the roofline step
model counts them."""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.executors.base import Executor, Modelled, has
from kvdeck.runtime.planning.machine import local_name
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile, user_profiles_dir
from kvdeck.runtime.planning.step_time import attention_flops

OVERHEAD = 2.0
"""A step taking more than this many times its floor is bound by neither limit: by fixed
costs (kernel launches, the host's own work)."""


@dataclass(frozen=True)
class StepRoofline:
    """One step against the roofline (`Peaks.step` makes it)."""

    step: int
    seconds: float
    bytes_read: float
    flops: float
    memory_s: float
    """The bandwidth floor: the step's bytes at peak bandwidth."""
    compute_s: float
    """Its FLOPs at peak compute."""

    @property
    def floor_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def gap_s(self) -> float:
        """Time beyond the floor."""
        return self.seconds - self.floor_s

    @property
    def bound(self) -> str:
        """`memory` or `compute` (the larger floor), or `overhead` when the step took more
        than `OVERHEAD` times its floor."""
        if self.seconds > OVERHEAD * self.floor_s:
            return "overhead"
        return "memory" if self.memory_s >= self.compute_s else "compute"

    def utilisation(self) -> tuple[float, float]:
        """(MBU, MFU): the floors over the time taken."""
        return self.memory_s / self.seconds, self.compute_s / self.seconds


@dataclass(frozen=True)
class Peaks:
    """What a roofline needs of a machine and a model: peak read bandwidth (bytes/s) and
    compute (FLOP/s), and what a new token's matmuls and one causal query–key pair's
    attention cost in FLOPs. A recording keeps them (a replay draws the same readout)."""

    bandwidth: float
    peak_flops: float
    flops_per_token: float
    flops_per_pair: float

    @classmethod
    def of(cls, model: ModelProfile, hw: HardwareProfile) -> Peaks:
        return cls(hw.bandwidth_bytes_per_s, hw.peak_flops, 2.0 * model.matrix_params,
                   attention_flops(model, 1))

    def step(self, record: StepRecord | None) -> StepRoofline | None:
        """`record` (a step that ran) against these peaks; None for a step that did not run
        or read nothing."""
        if record is None or not record.dt or not record.bytes_read:
            return None
        plan = record.plan
        new = sum(e[2] for e in plan)  # num_new_tokens; `causal_pairs` inlined: every row
        pairs = sum(n * s + n * (n + 1) // 2 for _, s, n, _, _ in plan)
        flops = self.flops_per_token * new + self.flops_per_pair * pairs
        return StepRoofline(record.step, record.dt, record.bytes_read, flops,
                            record.bytes_read / self.bandwidth, flops / self.peak_flops)


def executor_peaks(ex: Executor) -> Peaks | None:
    """The peaks an executor's steps are read against: the sim's card and model profiles;
    a real executor's model (its GGUF's shape) on this machine's peaks as `kvdeck calibrate`
    measured and kept them. None for a real executor on a machine not calibrated yet: a
    snapshot never measures the machine (that would take the cores the engine runs on)."""
    if has(ex, Modelled):
        return Peaks.of(ex.model, ex.hardware)
    info = ex.info
    if info.device == "gpu":  # llama.cpp offloading to a GPU it names no further
        return None
    hw = local_name(info.device)
    if not info.model_path or not (user_profiles_dir() / "hardware" / f"{hw}.toml").is_file():
        return None
    try:
        return Peaks.of(ModelProfile.from_gguf(str(info.model_path)), HardwareProfile.load(hw))
    except (KvdeckError, OSError, ValueError):
        return None  # a profile or model file one cannot read: no readout, as uncalibrated

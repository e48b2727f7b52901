"""The planner applied to a running engine (the console's plan screen, `P`): the profiles
of the card and model the engine runs on, the workload it is seeing, the scheme its knobs
make, and where it measures itself.

- **Profiles.** The sim executor's own hardware and model profiles, with the step fit it
  runs (config overrides included). A real executor: the model's profile generated from its
  GGUF, with the executor's online step fit (`executors/online_fit.py`) under the name
  `local`, and the `local` hardware profile measured on this machine (a few seconds, once).
- **Workload.** From the snapshot: the mean prompt, output and cached-prefix lengths of the
  requests in view, the arrival rate over the last minute of history, and the mean deadline
  where requests carry one (else `DEFAULT_DEADLINE_S`, said so).
- **Measured point.** Peak KV held by requests over that minute (GiB) against the mean
  end-to-end latency of finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvdeck.runtime.executors.base import Modelled, StepCost
from kvdeck.runtime.planning.planner import Plan, Planner, Scheme
from kvdeck.runtime.planning.power import nvml_power
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.planning.workloads import Workload
from kvdeck.runtime.views.snapshot import EngineSnapshot

DEFAULT_DEADLINE_S = 10.0
WINDOW_S = 60.0
"""History the workload's arrival rate and the measured KV peak are taken over."""


def live_profiles(engine) -> tuple[HardwareProfile, ModelProfile]:
    """The profiles the engine's executor runs on (see the module docstring)."""
    ex, info = engine.executor, engine.executor.info
    if isinstance(ex, Modelled) and isinstance(ex, StepCost):
        return ex.hardware, replace(ex.model, fits={ex.hardware.name: ex.fit})
    model = replace(ModelProfile.from_gguf(str(info.model_path)),
                    name=Path(str(info.model_path)).stem)
    if isinstance(ex, StepCost):
        model = replace(model, matrix_weight_bytes=int(ex.weight_bytes),
                        fits={"local": ex.fit})
    model = replace(model, kv_dtype=engine.switcher.kv_format)
    hw = HardwareProfile.load("local")
    if info.device.startswith("cuda"):  # energy at the measured draw, not the limit
        power = nvml_power(int(info.device.partition(":")[2] or 0))
        if power is not None:
            hw = replace(hw, power_watts=power.draw_w)
    return hw, model


@dataclass(frozen=True)
class LiveWorkload:
    workload: Workload
    deadline_assumed: bool
    measured_memory_bytes: float
    measured_e2e_s: float | None


def live_workload(snap: EngineSnapshot) -> LiveWorkload | None:
    """The workload the engine is seeing, or None before any request has arrived."""
    views = [*snap.finished, *snap.running, *snap.waiting]
    if not views:
        return None
    n = len(views)
    prompt = max(1, round(sum(v.prompt_tokens for v in views) / n))
    # What finished requests produced; what the others may still produce, at most.
    done = {v.request_id for v in snap.finished}
    output = max(1, round(sum(v.output_tokens if v.request_id in done else v.max_tokens
                              for v in views) / n))
    shared = min(prompt, round(sum(v.cached_tokens for v in views) / n))
    deadlines = [v.deadline - v.arrival_time for v in views if v.deadline is not None]
    deadline = sum(deadlines) / len(deadlines) if deadlines else DEFAULT_DEADLINE_S
    deadline = max(deadline, 1e-3)  # a trace may carry deadline 0: already late
    figures = snap.figures
    rate, peak_usage = 0.0, snap.kv.usage
    if figures is not None and figures.history:
        recent = [b for b in figures.history if b.start >= snap.time - WINDOW_S]
        span = max(snap.time - recent[0].start, figures.bucket_s) if recent else 1.0
        rate = sum(b.arrivals for b in recent) / span
        peak_usage = max([b.kv_usage for b in recent] + [snap.kv.usage])
    rate = max(rate, 1e-3)
    e2e = None
    if figures is not None and "e2e" in figures.histograms:
        h = figures.histograms["e2e"]
        e2e = h.sum / h.count if h.count else None
    kv = snap.kv
    memory = peak_usage * kv.num_blocks * kv.bytes_per_block
    w = Workload("live", "what the engine is seeing", prompt, output, shared, deadline,
                 "poisson", max(n, 1), rate)
    return LiveWorkload(w, not deadlines, memory, e2e)


def current_scheme(snap: EngineSnapshot, planner: Planner) -> Scheme:
    """The scheme the engine's knobs make: sharing when prefix caching is on and the
    workload has a shared prefix, the KV format (any 2-byte float as bf16). Speculation is
    not placed: the planner prices draft sources from profiles, not a live proposer."""
    k = snap.knobs
    fmt = k.kv_format if k.kv_format in ("q8_0", "q4_0") else "bf16"
    return Scheme(shared=k.enable_prefix_caching and planner.shared_blocks > 0, kv_format=fmt)


def live_plan(hw: HardwareProfile, model: ModelProfile, snap: EngineSnapshot,
              live: LiveWorkload) -> tuple[Planner, Plan]:
    """Plan the live workload against the engine's own KV pool and the knobs' token budget."""
    kv = snap.kv
    budget = kv.num_blocks * kv.bytes_per_block
    planner = Planner(hw, model, live.workload, budget, live.workload.deadline_s,
                      block_size=kv.block_size,
                      max_batched_tokens=snap.knobs.max_num_batched_tokens)
    return planner, planner.plan()

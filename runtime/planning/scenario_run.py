"""A planning scenario run in the sim and recorded (`kvdeck scenario run NAME --console`).

A `plan` scenario's setup names profiles, a budget, a workload and lettered schemes; the
planner chooses one. This runs the workload's requests through the sim executor on those
profiles and that budget under the chosen scheme (the first one when none is feasible), and
records the run, so the console's replay shows the scheme at work step by step: its batches,
its KV map and prefix tree, its speculation. How a scheme becomes the sim's settings:

- **shared prefix:** the requests share the workload's prefix tokens (a `prefix_group`) and
  prefix caching is on; without it every prompt is its own and caching is off;
- **KV format:** the `kv_format` knob;
- **speculation:** a draft source whose pass costs something runs as the sim's modelled
  draft model (`draft_cost`, its drafting); one whose pass fits inside the round (DFlash:
  `draft_cost` 0) as the sim's free proposer (the `ngram` method), both at a fixed draft
  length of the source's and at its acceptance — per position where the source gives them,
  else the constant rate whose expected tokens per round equal its measured ones;
- **weight offload:** not run here (the sim offloads whole FFN layers by count, the planner
  prices the scheme's bytes); such a scheme is refused in one sentence.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.planning.planner import Planner
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.planning.schemes import Scheme, parse_scheme
from kvdeck.runtime.planning.workloads import (
    DraftSource,
    Workload,
    constant_acceptance,
)
from kvdeck.runtime.runs.recording import record_headless
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival

GIB = 2**30


def _speculation(draft: DraftSource) -> tuple[dict, dict]:
    """(sim settings, knobs) that run `draft` as the sim models speculation."""
    acceptance = draft.acceptance[:draft.draft_length] or \
        (constant_acceptance(draft.tokens_per_round, draft.draft_length),)
    sim = {"spec_acceptance_profile": ",".join(f"{a:.4f}" for a in acceptance)}
    if draft.draft_cost:
        sim.update(draft_cost=draft.draft_cost, drafting=draft.drafting)
    knobs = {"speculative_method": "draft" if draft.draft_cost else "ngram",
             "num_speculative_tokens": draft.draft_length, "draft_length": "fixed"}
    return sim, knobs


def planner_of(setup: dict) -> tuple[Planner, dict[str, Scheme]]:
    """A plan scenario's planner (its profiles, workload, budget, deadline and draft
    sources) and its schemes by letter."""
    hw = HardwareProfile.load(setup.get("hardware", "rtx-pro-6000"))
    model = ModelProfile.load(setup.get("model", "qwen3-8b"))
    workload = Workload.load(setup.get("workload", "long-burst"))
    if "output_tokens" in setup:
        workload = replace(workload, output_tokens=int(setup["output_tokens"]))
    drafts = [DraftSource.load(n) for n in setup.get("drafts", [])]
    schemes = {letter: parse_scheme(text, drafts)
               for letter, text in dict(setup["schemes"]).items()}
    return Planner(hw, model, workload, float(setup["kv_budget_gib"]) * GIB,
                   setup.get("deadline_s"), drafts), schemes


def chosen_scheme(setup: dict) -> tuple[Scheme, Planner, bool]:
    """The setup's plan: the chosen scheme (else the first), the planner that chose it, and
    whether anything was feasible."""
    planner, schemes = planner_of(setup)
    plan = planner.plan(only=list(schemes.values()))
    first = next(iter(schemes.values()))
    return (plan.choice.scheme if plan.choice is not None else first), planner, \
        plan.choice is not None


def arrivals(workload: Workload, shared: bool) -> list[Arrival]:
    """The workload's requests: a burst at once, or Poisson arrivals at its rate."""
    rng, t, out = random.Random(0), 0.0, []
    for _ in range(workload.num_requests):
        out.append(Arrival(t, workload.prompt_tokens, workload.output_tokens,
                           prefix_group="shared" if shared and workload.shared_prefix_tokens
                           else None,
                           prefix_len=workload.shared_prefix_tokens if shared else 0,
                           deadline_s=workload.deadline_s))
        if workload.arrival == "poisson":
            t += rng.expovariate(workload.rate_per_s)
    return out


def record_scenario(kind: str, setup: dict, run_dir: str | Path) -> tuple[str, dict]:
    """Run a `plan` scenario's chosen scheme in the sim, recorded in `run_dir`; (the scheme's
    name, the run's summary)."""
    if kind != "plan":
        raise ConfigError(f"A {kind} scenario computes its figures without an engine run to "
                          "open; --console opens plan scenarios (kvdeck scenario list shows "
                          "their kind with --json).")
    scheme, planner, feasible = chosen_scheme(setup)
    if scheme.offload:
        raise ConfigError("The chosen scheme offloads weights, which the sim runs by layer "
                          "count and not as the planner prices it; no run to open.")
    sim, knobs = _speculation(scheme.draft) if scheme.draft is not None else ({}, {})
    executor = SimExecutor(SimConfig(model_profile=planner.model.name,
                                     hardware=planner.hw.name, **sim))
    engine = Engine(EngineConfig(
        kv_memory_bytes=int(planner.budget),
        knobs=Knobs(kv_format=scheme.kv_format, enable_prefix_caching=scheme.shared,
                    max_num_batched_tokens=8192, chunk_size=8192, **knobs)), executor)
    recorder = record_headless(engine, run_dir)
    try:
        result = run_arrivals(engine, arrivals(planner.workload, scheme.shared),
                              vocab_size=executor.info.vocab_size,
                              on_arrival=recorder.arrival)
    finally:
        recorder.close()
    engine.check_integrity()
    return scheme.name + ("" if feasible else " (nothing was feasible: the first scheme)"), \
        result["summary"]

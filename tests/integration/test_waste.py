"""Computed against useful tokens (`runtime/stats/waste.py`) on the sim: with prefix caching
off every position of a request is usefully computed exactly once, so what was computed
beyond `prompt + output − 1` per request is waste — recomputation after preemption, or
draft positions verification rejected — and the counter attributes all of it, live and in
replay alike."""

from __future__ import annotations

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.runs.recording import record_headless
from kvdeck.runtime.runs.replay import summarize_run
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival


def run(engine: Engine, tmp_path) -> dict:
    rec = record_headless(engine, tmp_path)
    arrivals = [Arrival(0.01 * i, 300 + 37 * (i % 7), 40 + 11 * (i % 5)) for i in range(24)]
    result = run_arrivals(engine, arrivals, vocab_size=32_000)
    rec.close()
    engine.check_integrity()
    return result


def useful_tokens(result: dict) -> int:
    return sum(r["prompt_tokens"] + r["output_tokens"] - 1 for r in result["requests"])


def test_recomputation_after_preemption_is_the_waste(tmp_path) -> None:
    ex = SimExecutor(SimConfig(timing="fit"), seed=3)
    per_block = 16 * ex.kv_bytes_per_token("bf16")
    engine = Engine(EngineConfig(kv_memory_bytes=160 * per_block, seed=3, knobs=Knobs(
        enable_prefix_caching=False, preemption="recompute", max_num_batched_tokens=1024,
        chunk_size=256)), ex)
    result = run(engine, tmp_path)
    s = result["summary"]
    assert s["num_preemptions"] > 0 and s["statuses"] == {"finished_length": 24}
    waste = engine.figures.waste.view()
    assert waste.computed == s["steps"]["prefill_tokens"] + s["steps"]["decode_tokens"]
    assert waste.useful == useful_tokens(result)
    assert waste.wasted["preemption"] == waste.computed - waste.useful > 0
    assert summarize_run(tmp_path)["steps"]["wasted_tokens"] == s["steps"]["wasted_tokens"]


def test_rejected_draft_positions_are_the_waste(tmp_path) -> None:
    ex = SimExecutor(SimConfig(timing="fit", draft_cost=0.1, spec_acceptance=0.6), seed=5)
    engine = Engine(EngineConfig(kv_memory_bytes=8 << 30, seed=5, knobs=Knobs(
        enable_prefix_caching=False, speculative_method="draft", num_speculative_tokens=4)),
        ex)
    result = run(engine, tmp_path)
    waste = engine.figures.waste.view()
    spec = engine.scheduler.spec
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    assert waste.wasted["rejected drafts"] == rejected > 0
    assert waste.useful == useful_tokens(result)
    assert sum(waste.wasted.values()) == rejected  # nothing else was computed twice
    summary = summarize_run(tmp_path)["steps"]
    assert summary["computed_tokens"] == waste.computed
    assert summary["wasted_tokens"] == waste.wasted


def test_a_switch_s_own_preemptions_are_its_waste_and_checkpoints_stand_still() -> None:
    from kvdeck.runtime.core.step_record import Finished, PlanEntry, StepRecord
    from kvdeck.runtime.core.switch import Switch
    from kvdeck.runtime.stats.waste import Waste

    waste = Waste()
    waste.on_record(StepRecord(0, dt=0.1, plan=[PlanEntry("a", 0, 64, 1),
                                                PlanEntry("b", 0, 32, 1)]), 96)
    saved = waste.to_json()
    # A smaller pool preempts `a` (the switch's list, not the plan's); `b` is preempted to
    # make room in the same step: each recomputes for its own reason.
    shrink = Switch("kv_format", "bf16", "q8_0", 0.01, False, 0, preempted=("a",))
    waste.on_record(StepRecord(1, dt=0.1, plan=[PlanEntry("c", 0, 16, 1)], preempted=["b"],
                               switches=[shrink], dropped={"a": 64, "b": 32}), 16)
    waste.on_record(StepRecord(2, dt=0.1, plan=[PlanEntry("a", 0, 64, 1),
                                                PlanEntry("b", 0, 32, 1)],
                               finished=[Finished("a", "finished_length", None, 0.3)]), 96)
    view = waste.view()
    assert view.wasted["format switch"] == 64 and view.wasted["preemption"] == 32
    assert view.computed == 64 + 32 + 16 + 64 + 32 and view.useful == 64 + 32 + 16
    assert saved["wasted"] == dict.fromkeys(saved["wasted"], 0) and saved["computed"] == 96


def test_kv_dropped_with_no_preemption_or_switch_is_lost_kv_and_counted_once() -> None:
    """A failed step that had copied KV out drops the swapped requests' host copies: the
    record names them in `dropped` only. A switch in a step that ran nothing still counts.
    A request recomputing in chunks wastes exactly what it had, once."""
    from kvdeck.runtime.core.step_record import PlanEntry, StepRecord
    from kvdeck.runtime.core.switch import Switch
    from kvdeck.runtime.stats.waste import Waste

    waste = Waste()
    waste.on_record(StepRecord(0, dt=0.1, dropped={"a": 40}), 0)
    off = Switch("offload_layers", "0", "4", 0.01, False, 0, unswapped=("b",))
    waste.on_idle(StepRecord(1, switches=[off], dropped={"b": 10}))
    for step, start in enumerate((0, 16, 32), start=2):  # `a` in chunks of 16; `b` whole
        plan = [PlanEntry("a", start, 16, 0)] + ([PlanEntry("b", 0, 12, 1)] if start == 0
                                                  else [])
        waste.on_record(StepRecord(step, dt=0.1, plan=plan), 16 + 12 * (start == 0))
    assert waste.wasted["lost KV"] == 40 and waste.wasted["offload switch"] == 10
    assert waste.computed == 48 + 12 and waste.view().useful == 10

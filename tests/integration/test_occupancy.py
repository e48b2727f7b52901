"""Per-request accelerator occupancy: `t_GPU = L/r_P + (G − 1)/r_D`, charged by the engine
step by step and recomputed the same way by replay.

Chapter 000 works it for its scheme B (8K prompts, 6K of them cached, a batch of 16): the
prefill step computes 32,768 new tokens in 2.04 s and each decode step takes 27.35 ms, so
r_P ≈ 16,059 tokens/s, r_D = 16 / 0.02735 ≈ 585 calls/s, and each request occupies
2048/16059 + 255/585 ≈ 0.563 accelerator seconds (9.01 for the 16). Here the sim is given
the two measured step times (a fixed cost and a per-token cost solved from them) and the
engine's own accounting must come out at the chapter's figures. (Replay recomputes the same
charges: `test_engine_sim.view_of` holds them equal step by step.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.views.snapshot import snapshot_of

PREFILL_S, DECODE_S = 2.04, 0.02735
"""The chapter's measured step times (Experiment 8-1's conditions)."""
BATCH, PROMPT, CACHED, OUTPUTS = 16, 8192, 6144, 256


def scheme_b_engine() -> Engine:
    # Solve fixed + per_token·n through the two measured steps (n = 32,768 and 16).
    per_token = (PREFILL_S - DECODE_S) / (BATCH * (PROMPT - CACHED) - BATCH)
    fixed = DECODE_S - BATCH * per_token
    sim = SimConfig(timing="fit", fixed_ms=fixed * 1e3, per_token_us=per_token * 1e6,
                    per_pair_ns=0.0)
    knobs = Knobs(max_num_batched_tokens=BATCH * (PROMPT - CACHED),
                  chunk_size=BATCH * (PROMPT - CACHED), max_num_seqs=BATCH)
    config = EngineConfig(block_size=16, num_blocks=3_000, seed=1, knobs=knobs)
    return Engine(config, SimExecutor(sim, seed=1))


def arrivals() -> list[Arrival]:
    # One request warms the cache with the 6K prefix; the batch arrives after it is done.
    warm = Arrival(0.0, CACHED + 1, 1, prefix_group="doc", prefix_len=CACHED)
    return [warm] + [Arrival(100.0, PROMPT, OUTPUTS, prefix_group="doc", prefix_len=CACHED)
                     for _ in range(BATCH)]


def test_scheme_b_occupancy_is_the_chapters(tmp_path: Path) -> None:
    engine = scheme_b_engine()
    rec = record_headless(engine, tmp_path)
    run_arrivals(engine, arrivals(), vocab_size=32_000, on_arrival=rec.arrival)
    rec.close()
    engine.check_integrity()
    views = [v for v in snapshot_of(engine).finished if v.prompt_tokens == PROMPT]
    assert len(views) == BATCH
    for v in views:
        assert v.prefill_new == PROMPT - CACHED and v.decode_calls == OUTPUTS - 1
        assert v.r_P == pytest.approx(16_059, rel=0.001)
        assert v.r_D == pytest.approx(585, rel=0.001)
        assert v.accelerator_s == pytest.approx(0.563, abs=0.0005)
    assert sum(v.accelerator_s for v in views) == pytest.approx(9.01, abs=0.01)
    # The occupancy counts each step once: the batch's charges add up to its busy time.
    _, records = read_run(tmp_path)
    busy = sum(r.dt for r in records if getattr(r, "dt", None) and r.t0 >= 100.0)
    assert sum(v.accelerator_s for v in views) == pytest.approx(busy, rel=1e-9)


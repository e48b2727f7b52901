"""llama-server's saves of idle slots (`planning/slot_save.py`): a save's time by the bytes
of the state it saves, the saves each probe request waited for, the profile's table, and a
sim run behind `--server-slots` holding a launch for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.planning.calibrate import Point, fit_toml
from kvdeck.runtime.planning.profiles import ModelProfile, StepFit, profiles_dir
from kvdeck.runtime.planning.slot_save import SlotSaves, save_seconds
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival


def test_a_save_takes_the_time_of_the_bytes_its_state_holds() -> None:
    """Gemma 3 270M: a state holds every token in its 3 global layers and at most 513 in
    its 15 sliding ones, 1 KiB a token and layer; llama-server's log says 9.856 MiB for 799
    tokens and 0.089 for 5 (the state's header and token ids add a few KiB at most)."""
    gemma = ModelProfile.load("gemma3-270m")
    assert gemma.kv_bytes(799, 1) / 2**20 == pytest.approx(9.856, abs=2e-3)
    assert gemma.kv_bytes(5, 1) / 2**20 == pytest.approx(0.089, abs=2e-3)
    seconds = save_seconds(gemma, ((1536, 0.020),))
    assert seconds(1536) == pytest.approx(0.020)
    # 799 tokens: 9.86 of 1,536's 12.01 MiB, not 799/1536 of its time.
    assert seconds(799) == pytest.approx(0.020 * 9.8555 / 12.0146, rel=1e-3)
    assert seconds(0) == 0.0


def test_each_probe_request_pays_for_the_states_left_before_its_launch() -> None:
    saves = SlotSaves(lambda n: n * 1e-3)

    def sent(prompt: int, outputs: int) -> Arrival:
        return Arrival(0.0, prompt, outputs)

    # One at a time: each pays for the one before (its prompt and outputs but the last).
    assert saves.one_by_one([sent(10, 1), sent(20, 3)]) == pytest.approx([0.0, 0.010])
    # At once: the first launched pays for what the last one left (22 tokens).
    assert saves.together([sent(5, 3), sent(6, 3)]) == pytest.approx([0.022, 0.0])
    # A decoder, then prompts one at a time beside it: the decoder pays for both states
    # (7 and 8 tokens), the first prompt for none, each other for the prompt before.
    assert saves.beside(sent(30, 10), [sent(4, 1), sent(5, 1), sent(6, 1)]) == \
        pytest.approx([0.015, 0.0, 0.004, 0.005])
    assert saves.pending == [39, 6]
    # Sent after the one before (6 tokens), sharing its prefix: it takes that slot, which is
    # not saved, and saves the other state left (39).
    assert saves.sharing(sent(12, 2)) == pytest.approx(0.039)
    assert saves.pending == [13]


def with_saves(tmp_path: Path, monkeypatch, table: str, name: str = "saves") -> str:
    """A user profile `name`: the shipped qwen3-8b one with `table` added."""
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    models = tmp_path / "profiles" / "models"
    models.mkdir(parents=True, exist_ok=True)
    shipped = (profiles_dir() / "models" / "qwen3-8b.toml").read_text()
    (models / f"{name}.toml").write_text(
        shipped.replace('name = "qwen3-8b"', f'name = "{name}"') + "\n" + table)
    return name


def test_the_profile_keeps_a_timed_save_and_refuses_a_bad_one(tmp_path: Path,
                                                              monkeypatch) -> None:
    written = fit_toml(StepFit(0.02, 1e-3, 0.0), "h100-sxm",
                       [Point("save", 1536, 0, "save 1536", 0.02, 1536)])
    assert "[slot_save.h100-sxm]\npoints = [[1536, 20.000]]\n" in written
    name = with_saves(tmp_path, monkeypatch, written[written.index("[slot_save"):])
    assert ModelProfile.load(name).slot_saves == {"h100-sxm": ((1536, 0.02),)}
    name = with_saves(tmp_path, monkeypatch, "[slot_save.h100-sxm]\npoints = [[1536, 0]]\n",
                      "bad")
    with pytest.raises(ConfigError, match=r"slot_save\.h100-sxm\.points must be a list of "
                                          r"\[tokens, milliseconds\] pairs"):
        ModelProfile.load(name)


def test_a_trace_behind_slots_runs_the_requests_that_came_during_a_save_together(
        tmp_path: Path, monkeypatch) -> None:
    """With the profile's save (16 tokens in 16 ms: qwen3-8b has no sliding layers, so a
    token a millisecond): A ends; B's launch, 1 s later, saves A's 18-token state for 18 ms,
    in which C comes in (10 ms after B), and both prompts run in one step."""
    name = with_saves(tmp_path, monkeypatch, "[slot_save.h100-sxm]\npoints = [[16, 16.0]]\n")
    sim = SimExecutor(SimConfig(model_profile=name, hardware="h100-sxm", timing="fit",
                                fixed_ms=20, per_token_us=1000, per_pair_ns=0,
                                server_slots=4))
    e = Engine(EngineConfig(kv_memory_bytes=1 << 30, knobs=Knobs(max_num_seqs=4)), sim)
    arrivals = [Arrival(t, 16, 3, prompt_tokens=tuple(range(n, n + 16)))
                for t, n in ((0.0, 100), (1.0, 200), (1.01, 300))]
    out = run_arrivals(e, arrivals, vocab_size=32_000)
    e.check_integrity()
    ttft = [r["ttft"] for r in out["requests"]]
    assert ttft[1] == pytest.approx(0.018 + 0.020 + 0.032)  # the save, two 16-token prompts
    assert ttft[2] == pytest.approx(ttft[1] - 0.01)  # the same first step, 10 ms later sent


def test_without_a_prompt_cache_a_launch_saves_nothing(tmp_path: Path, monkeypatch) -> None:
    """The same trace with `--server-cache-ram 0` (llama-server's `--cache-ram 0`): B's
    launch waits for no save, and C, 10 ms behind, gets a step of its own. The cache's
    token limit is the pool's tokens where no server context is given (below)."""
    name = with_saves(tmp_path, monkeypatch, "[slot_save.h100-sxm]\npoints = [[16, 16.0]]\n")
    ttft = {}
    for ram in (0, 8192):
        sim = SimExecutor(SimConfig(model_profile=name, hardware="h100-sxm", timing="fit",
                                    fixed_ms=20, per_token_us=1000, per_pair_ns=0,
                                    server_slots=4, server_cache_ram_mib=ram))
        e = Engine(EngineConfig(num_blocks=64, knobs=Knobs(max_num_seqs=4)), sim)
        assert sim.slots.cache.context_tokens == 64 * 16
        arrivals = [Arrival(t, 16, 3, prompt_tokens=tuple(range(n, n + 16)))
                    for t, n in ((0.0, 100), (1.0, 200), (1.01, 300))]
        out = run_arrivals(e, arrivals, vocab_size=32_000)
        e.check_integrity()
        ttft[ram] = [r["ttft"] for r in out["requests"]]
    assert sim.slots.cache.states  # 8,192 MiB: the states were saved
    assert ttft[0][1] == pytest.approx(0.020 + 0.016)
    assert ttft[0][2] > ttft[0][1]  # C's first token after B's: not in B's step
    assert ttft[8192][1] == pytest.approx(0.018 + 0.020 + 0.032)


def test_the_prompt_cache_takes_the_server_context_and_the_pools_kv_format() -> None:
    """`--server-context` is its token limit; a state's bytes are its KV's in the pool's
    format, there and after a live switch."""
    sim = SimExecutor(SimConfig(model_profile="qwen3-8b", hardware="h100-sxm", server_slots=4,
                                server_context_tokens=16384))
    e = Engine(EngineConfig(num_blocks=64, knobs=Knobs(kv_format="q8_0")), sim)
    cache = sim.slots.cache
    assert cache.context_tokens == 16384
    assert cache.state_bytes(799) == sim.model.kv_bytes(799, 1, "q8_0") < \
        sim.model.kv_bytes(799, 1, "fp16")
    e.set_knobs(kv_format="fp16")
    e.step()
    assert cache.state_bytes(799) == sim.model.kv_bytes(799, 1, "fp16")
    assert cache.context_tokens == 16384

"""The chapters' worked examples as scenarios: each one's figures, computed by kvdeck's
planner, step model, KV arithmetic and sim, hold against the chapter's within the
tolerance the scenario states (its note says why where a figure is held looser)."""

from __future__ import annotations

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.scenarios import KINDS, Scenario, scenario_names
from kvdeck.runtime.planning.schemes import Scheme, parse_scheme
from kvdeck.runtime.planning.workloads import DraftSource


@pytest.mark.parametrize("name", scenario_names())
def test_every_scenario_holds_against_its_chapter(name: str) -> None:
    scenario = Scenario.load(name)
    figures = scenario.run()
    assert figures and scenario.source
    missed = [(f.name, f.chapter, f.kvdeck) for f in figures if f.holds == f.inconsistent]
    assert not missed, missed  # an inconsistent figure must differ, the others hold
    assert not any(f.inconsistent for f in figures) or scenario.note
    # Each scenario predicts something: not every figure is one a profile was measured on.
    assert any(not f.calibration for f in figures)
    # A figure held looser than the scenario's tolerance is explained in its note.
    assert not scenario.tolerances or scenario.note


def test_the_comprehensive_example_chooses_speculation_on_the_shared_prefix() -> None:
    figures = {f.name: f.kvdeck for f in Scenario.load("comprehensive").run()}
    assert figures["choice"] == "D"
    assert figures["A.memory_gib"] > 12 and figures["B.completion_s"] > 7
    assert figures["C.completion_s"] > 7 and figures["D.completion_s"] < 7


def test_scenarios_cover_every_kind() -> None:
    assert {Scenario.load(n).kind for n in scenario_names()} == set(KINDS)


def test_a_figure_kvdeck_does_not_compute_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    folder = tmp_path / "profiles" / "scenarios"
    folder.mkdir(parents=True)
    (folder / "odd.toml").write_text('kind = "offload"\n[setup]\nlayers = 1\n'
                                     '[chapter]\nwatts = 3\n')
    with pytest.raises(ConfigError, match="kvdeck computes no watts for a offload scenario"):
        Scenario.load("odd").run()
    (folder / "odd.toml").write_text('kind = "magic"\n[chapter]\nx = 1\n')
    with pytest.raises(ConfigError, match="kind must be one of"):
        Scenario.load("odd")


def test_schemes_parse_from_their_parts() -> None:
    d = DraftSource("dflash", "", "*", "parallel", 7, 0, 0, 0.0, 0.0, (), tokens_per_round=3.0)
    assert parse_scheme("baseline", [d]) == Scheme()
    assert parse_scheme("shared + q8_0 + dflash", [d]) == Scheme(True, "q8_0", d)
    assert parse_scheme("offload", []).offload
    with pytest.raises(ConfigError, match="Unknown scheme part 'fp8'"):
        parse_scheme("shared+fp8", [d])
    assert d.expected_outputs() == 3.0
    with pytest.raises(ConfigError, match="tokens per round only at 7 drafts"):
        d.expected_outputs(3)


def test_a_task_s_time_with_a_sped_up_phase_and_added_work() -> None:
    from kvdeck.runtime.planning.amdahl import task_seconds, task_speedup

    task = {"prefill": 20.0, "decode": 50.0, "tools": 30.0}
    assert task_seconds(task, {"decode": 4.0}, added_s=8.0) == pytest.approx(20 + 12.5 + 30 + 8)
    assert task_speedup(0.5, 4.0) == pytest.approx(100 / 62.5)
    with pytest.raises(ValueError, match="no phase draft"):
        task_seconds(task, {"draft": 2.0})


def test_a_plan_scenario_runs_its_chosen_scheme_in_the_sim_recorded(tmp_path) -> None:
    """`scenario run comprehensive --console` runs scheme D (shared prefix + DFlash) in the
    sim and records it; the recording replays to the same figures."""
    from kvdeck.runtime.planning.scenario_run import constant_acceptance, record_scenario
    from kvdeck.runtime.planning.workloads import expected_outputs
    from kvdeck.runtime.runs.replay import summarize_run

    a = constant_acceptance(3.0, 7)
    assert expected_outputs((a,) * 7) == pytest.approx(3.0)
    s = Scenario.load("comprehensive")
    scheme, summary = record_scenario(s.kind, s.setup, tmp_path / "run")
    assert scheme == "shared prefix + spec dflash-qwen3-8b"
    assert summary["statuses"] == {"finished_length": 16}
    replayed = summarize_run(tmp_path / "run")
    assert replayed["ttft_s"] == summary["ttft_s"] and replayed["e2e_s"] == summary["e2e_s"]
    # The run speculated at DFlash's measured rate: about 3 tokens a round.
    spec = replayed["steps"]
    assert spec["computed_tokens"] > spec["wasted_tokens"]["rejected drafts"] > 0
    with pytest.raises(ConfigError, match="computes its figures without an engine run"):
        record_scenario("retention", {}, tmp_path / "no")

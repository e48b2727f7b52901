"""The sim-against-real benchmark's own arithmetic: the fit's points from two probe rounds,
the server's drift between them, and its speed beside each trace (the speed checks over
the rounds' probes, and the points at that speed)."""

import argparse
from dataclasses import replace

import pytest

from benchmarks.sim_vs_real import (
    MARGIN,
    SPEED,
    at_speed,
    drift,
    main,
    median_figures,
    merged,
    runs_count,
    show,
    speed,
)
from kvdeck.runtime.planning.calibrate import Point
from kvdeck.runtime.planning.probe import FULL


def point(label: str, seconds: float) -> Point:
    """A prefill probe of 64 tokens, timed from outside, under `label`."""
    return Point("prefill", 64, 2080, label, seconds, 64, 1, True)


def test_points_are_the_median_of_both_rounds_and_a_probe_one_round_lacks_is_left_out():
    before = [point("prefill 64", 0.100), point("prefill 64 on 512", 0.150),
              point("prefill 256", 0.300)]
    after = [point("prefill 64", 0.140), point("prefill 256", 0.240)]
    got = merged(before, after, [])
    assert [p.label for p in got] == ["prefill 64", "prefill 256"]
    assert [round(p.seconds, 6) for p in got] == [0.12, 0.27]
    assert got[0].new_tokens == 64 and got[0].outside  # the rest of the point kept


def test_a_wake_point_is_the_median_of_every_round_that_timed_it():
    """Both probe rounds and the wake rounds sent after each trace."""
    def wake(idle: float, seconds: float) -> Point:
        return Point("wake", 64, 2080, f"wake after {idle:g} s", seconds, 64, outside=True,
                     idle_s=idle)
    before = [point("prefill 64", 0.100), wake(5, 0.000), wake(20, 0.010)]
    after = [point("prefill 64", 0.100), wake(5, 0.010), wake(20, 0.020)]
    got = merged(before, after, [[wake(5, 0.040), wake(20, 0.760)], [wake(5, 0.030)]])
    assert [(p.label, round(p.seconds, 6)) for p in got] == [
        ("prefill 64", 0.1), ("wake after 5 s", 0.02), ("wake after 20 s", 0.02)]
    assert got[1].idle_s == 5 and got[1].kind == "wake"


def test_drift_is_after_over_before_per_probe():
    before = [point("a", 0.100), point("b", 0.200), point("c", 0.400), point("d", 1.0)]
    after = [point("a", 0.150), point("b", 0.180), point("c", 0.400)]
    got = drift(before, after)
    assert {k: round(v, 9) for k, v in got.items()} == {"median": 1.0, "min": 0.9, "max": 1.5}


def test_drift_without_a_probe_in_common_is_not_a_number():
    got = drift([point("a", 0.1)], [point("b", 0.1)])
    assert all(v != v for v in got.values())  # NaN, and no exception mid-benchmark


def decode(label: str, seconds: float) -> Point:
    """A decode step of one row, under `label`."""
    return Point("decode", 1, 77, label, seconds, 77)


def test_speed_is_the_median_check_over_the_same_probe_for_prefill_and_decode_apart():
    points = [point("prefill 512", 0.700), decode("decode 1 at 76", 0.015),
              decode("decode 4 at 76", 0.036)]
    checks = [point("prefill 512", 0.770), decode("decode 1 at 76", 0.0165),
              decode("decode 4 at 76", 0.036), point("prefill 512", 0.735),
              decode("decode 1 at 76", 0.015), decode("decode 4 at 76", 0.0396)]
    got = speed(checks, points)
    assert round(got["prefill"], 6) == 1.075  # (1.10 + 1.05) / 2
    assert round(got["decode"], 6) == 1.05  # median of 1.10, 1.00, 1.00, 1.10


def test_a_check_no_probe_matches_leaves_the_speed_at_one():
    got = speed([point("prefill 64", 0.2)], [point("prefill 512", 0.7)])
    assert got == {"prefill": 1.0, "decode": 1.0}


def test_wake_and_save_points_give_no_speed():
    """Each is a small difference of two timings, no step: a check's would be noise."""
    wake = Point("wake", 64, 2080, "wake after 5 s", 0.020, 64, outside=True, idle_s=5)
    save = Point("save", 1536, 0, "save 1536", 0.040, 1536)
    points = [replace(wake, seconds=0.010), replace(save, seconds=0.020)]
    assert speed([wake, save], points) == {"prefill": 1.0, "decode": 1.0}


def test_the_speed_checks_are_probes_the_rounds_send():
    """Their labels must be the rounds' for `speed` to match them: the same prompt lengths,
    batches and outputs (a decode point's label carries its context, prompt + outputs / 2)."""
    assert set(SPEED.prefill) <= set(FULL.prefill)
    assert set(SPEED.decode) <= set(FULL.decode)
    assert SPEED.outputs == FULL.outputs


def test_points_at_speed_scale_each_kind_by_its_factor_and_leave_wakes_and_saves():
    wake = Point("wake", 64, 2080, "wake after 5 s", 0.010, 64, outside=True, idle_s=5)
    save = Point("save", 1536, 0, "save 1536", 0.020, 1536)
    mixed = Point("mixed", 65, 2473, "prefill 64 beside a decode of 384", 0.036, 457, 2)
    got = at_speed([point("prefill 64", 0.100), decode("decode 1 at 76", 0.015), mixed,
                    wake, save], {"prefill": 1.21, "decode": 1.0})
    assert [round(p.seconds, 6) for p in got] == [0.121, 0.015, 0.0396, 0.010, 0.020]
    assert got[0].outside and got[2].kind == "mixed"  # the rest of each point kept


def test_the_verdict_is_the_prediction_as_probed_and_the_one_at_speed_stands_beside(capsys):
    """The prediction made with the rounds' fit, before anything of the trace is measured,
    gives the verdict; the one at the speed of the checks is marked where it misses."""
    figures = {"ttft_p50_s": 1.0, "tpot_p50_s": 0.05, "output_tokens_per_s": 10.0}
    row = {"server": "llama-server --no-repack", "trace": "shared prefix",
           "predicted": figures, "measured": figures,
           "ratio": {"ttft_p50_s": 1.14, "tpot_p50_s": 0.9, "output_tokens_per_s": 1.0},
           "ratio_at_speed": {"ttft_p50_s": 0.95, "tpot_p50_s": 0.76},
           "speed": {"prefill": 0.82, "decode": 0.97},
           "drift": {"median": 1.0, "min": 0.9, "max": 1.1}}
    show([row])
    line = capsys.readouterr().out.splitlines()[-1]
    assert "within ±15%" in line and "0.95/0.76!" in line and "1.14" in line
    show([{**row, "ratio": {**row["ratio"], "tpot_p50_s": 0.8}}])
    assert "MISSES ±15%" in capsys.readouterr().out


def test_measured_figures_are_the_median_over_the_runs_each_figure_apart():
    runs = [{"ttft_p50_s": 1.0, "tpot_p50_s": 0.050}, {"ttft_p50_s": 1.4, "tpot_p50_s": 0.070},
            {"ttft_p50_s": 1.1, "tpot_p50_s": 0.036}]
    assert median_figures(runs) == {"ttft_p50_s": 1.1, "tpot_p50_s": 0.05}
    assert median_figures(runs[:1]) == runs[0]
    assert median_figures(runs[:2]) == pytest.approx({"ttft_p50_s": 1.2, "tpot_p50_s": 0.06})


def test_each_run_is_shown_beside_the_verdict_on_their_median(capsys):
    """The verdict is the median's; each run's own ratios stand beside it, and how many of
    them alone came within the bound."""
    figures = {"ttft_p50_s": 1.0, "tpot_p50_s": 0.05, "output_tokens_per_s": 10.0}
    ratio = {"ttft_p50_s": 1.02, "tpot_p50_s": 0.97, "output_tokens_per_s": 1.0}
    row = {"server": "llama-server --no-repack", "trace": "shared prefix",
           "predicted": figures, "measured": figures, "ratio": ratio,
           "ratio_at_speed": ratio, "speed": {"prefill": 1.0, "decode": 1.0},
           "drift": {"median": 1.0, "min": 0.9, "max": 1.1},
           "runs": [{"ratio": ratio}, {"ratio": {**ratio, "tpot_p50_s": 0.72}},
                    {"ratio": {**ratio, "ttft_p50_s": 1.1}}]}
    show([row])
    out = capsys.readouterr().out.splitlines()
    assert "within ±15%" in out[-2]
    assert out[-1].split() == ["each", "run:", "1.02/0.97,", "1.02/0.72,", "1.10/0.97",
                               "(2", "of", "3", "within)"]
    show([{**row, "runs": row["runs"][:1]}])  # one run: its ratios are the verdict's
    assert "each run" not in capsys.readouterr().out


def test_repeat_takes_a_whole_number_of_runs_and_says_what_is_allowed():
    assert runs_count("3") == 3
    for bad in ("0", "-1", "two", "1.5", "²"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            runs_count(bad)
        assert str(e.value).startswith(f"{bad!r} is not a number of runs")
    with pytest.raises(argparse.ArgumentTypeError):
        main(repeat=0)  # the same rule from Python, before any server starts


def test_a_prediction_with_an_arrival_near_a_step_start_is_marked_a_coin_toss(capsys):
    figures = {"ttft_p50_s": 1.0, "tpot_p50_s": 0.05, "output_tokens_per_s": 10.0}
    ratio = {"ttft_p50_s": 1.0, "tpot_p50_s": 1.0, "output_tokens_per_s": 1.0}
    row = {"server": "llama-server --no-repack", "trace": "Mooncake excerpt",
           "predicted": figures, "measured": figures, "ratio": ratio,
           "ratio_at_speed": ratio, "speed": {"prefill": 1.0, "decode": 1.0},
           "drift": {"median": 1.0, "min": 1.0, "max": 1.0}, "close_call_s": 0.0002}
    line = row_line(row, 0.0002, capsys)
    assert "closest call: an arrival 0.2 ms" in line and "coin toss" in line
    assert "coin toss" not in row_line(row, MARGIN, capsys)
    assert row_line(row, None, capsys).endswith("closest call: none")


def row_line(row: dict, close: float | None, capsys) -> str:
    """The last line `show` prints for `row` with its closest call at `close` seconds."""
    show([{**row, "close_call_s": close}])
    return capsys.readouterr().out.splitlines()[-1]

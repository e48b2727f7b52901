"""Request timing formulas, percentiles, goodput under SLOs."""

from __future__ import annotations

import numpy as np
import pytest

from kvdeck.runtime.core.request import Request, RequestStatus, SamplingParams
from kvdeck.runtime.stats.figures import RunFigures, summarize
from kvdeck.runtime.stats.metrics import SLO, Distribution, percentile, request_metrics


def finished(rid: str, arrival: float, times: list[float], deadline: float | None = None,
             status: RequestStatus = RequestStatus.FINISHED_LENGTH) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=len(times)), arrival_time=arrival,
                deadline=deadline)
    r.admitted_time = arrival + 0.5
    r.output_token_ids = [7] * len(times)
    r.token_times = list(times)
    r.first_token_time = times[0] if times else None
    r.finish_time = times[-1] if times else arrival
    r.status = status
    return r


def test_request_formulas() -> None:
    m = request_metrics(finished("a", 1.0, [2.0, 2.5, 3.5, 4.0], deadline=5.0))
    assert m.ttft == 1.0 and m.queue_time == 0.5
    assert m.itls == (0.5, 1.0, 0.5)
    assert m.e2e == 3.0 == m.ttft + sum(m.itls)
    assert m.tpot == pytest.approx((3.0 - 1.0) / 3)
    assert m.met_deadline is True
    single = request_metrics(finished("b", 0.0, [1.0]))
    assert single.tpot is None and single.itls == () and single.e2e == 1.0
    late = request_metrics(finished("c", 0.0, [1.0, 9.0], deadline=5.0))
    assert late.met_deadline is False


def test_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = sorted(rng.exponential(size=101).tolist())
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    d = Distribution.of([3.0, 1.0, 2.0])
    assert (d.count, d.mean, d.p50) == (3, 2.0, 2.0)
    assert Distribution.of([]).mean is None


def test_goodput_counts_only_requests_meeting_slos_and_correct() -> None:
    reqs = [
        finished("fast", 0.0, [0.1, 0.2, 0.3]),
        finished("slow-ttft", 0.0, [2.0, 2.1]),
        finished("late", 0.0, [0.1, 6.0], deadline=5.0),
        finished("wrong", 0.0, [0.1, 0.2]),
        finished("right", 0.0, [0.1, 0.2]),
        finished("aborted", 0.0, [0.1], status=RequestStatus.ABORTED),
    ]
    reqs[3].correct, reqs[4].correct = False, True
    ms = [request_metrics(r) for r in reqs]
    stats = RunFigures()
    stats.busy_seconds = 3.0
    s = summarize(ms, stats, SLO(ttft_s=1.0))
    assert s["num_good"] == 2  # fast, and right: wrong met the SLO but failed its check
    assert (s["num_checked"], s["num_correct"]) == (2, 1)
    assert s["makespan_s"] == 6.0
    assert s["goodput_rps"] == pytest.approx(2 / 6.0)
    assert s["completion_throughput_rps"] == pytest.approx(5 / 6.0)
    assert s["accelerator_s_per_good_result"] == 1.5
    assert s["statuses"] == {"finished_length": 5, "aborted": 1}


def test_running_figures_count_checks_and_keep_failures_out_of_goodput() -> None:
    """The engine's figures (what /metrics, the console and replay read): a failed check is
    finished but not good; the counts survive a checkpoint, and a checkpoint written before
    checks existed loads with none."""
    f = RunFigures()
    outcomes = {"unchecked": None, "right": True, "wrong": False, "wrong-late": False}
    for i, (rid, correct) in enumerate(outcomes.items()):
        r = finished(rid, 0.0, [0.1, 0.2 + i], deadline=9.0 if rid != "wrong-late" else 0.1)
        r.correct = correct
        f.on_finish(request_metrics(r))
    assert (f.num_good, f.num_checked, f.num_check_failures) == (2, 3, 2)
    rolling = f.rolling()
    assert rolling["good_fraction"] == 0.5 and rolling["has_checks"]
    view = f.view()
    assert (view.num_good, view.num_checked, view.num_check_failures) == (2, 3, 2)
    again = RunFigures()
    again.load(f.to_json())
    assert (again.num_good, again.num_checked, again.num_check_failures) == (2, 3, 2)
    assert [m.correct for m in again.recent] == list(outcomes.values())
    old = f.to_json()
    del old["num_checked"], old["num_check_failures"]
    for m in old["recent"]:
        del m["correct"]
    before = RunFigures()
    before.load(old)
    assert (before.num_checked, before.num_check_failures) == (0, 0)
    assert not before.rolling()["has_checks"]


def test_bad_slo_is_refused() -> None:
    with pytest.raises(Exception, match="ttft_s must be a number from 0 to 1e\\+09"):
        SLO(ttft_s=-1.0)


def test_step_model_error_over_a_sliding_window_of_steps() -> None:
    """The metrics panel's predicted-vs-measured figures: means over the latest `window`
    steps that took time, kept incrementally, the same after a checkpoint round trip."""
    from kvdeck.runtime.stats.figures import StepFigures

    f = RunFigures(window=3)
    assert f.step_model() is None
    steps = [(0.010, 0.010), (0.020, 0.025), (0.030, 0.0), (0.040, 0.050), (0.050, 0.040)]
    for i, (p, m) in enumerate(steps):
        f.on_step(StepFigures(t1=i + 1.0, dt=m, num_seqs=1, prefill_tokens=0, decode_tokens=1,
                              sampled_tokens=1, finished=0, arrivals=0, resident=1,
                              kv_usage=0.0, kv_cached=0.0, hit_rate=0.0, running=1,
                              waiting=0, knob_change=False, predicted=p))
    kept = [(0.020, 0.025), (0.040, 0.050), (0.050, 0.040)]  # the zero-time step is skipped
    want = (np.mean([p for p, _ in kept]), np.mean([m for _, m in kept]),
            np.mean([abs(p - m) / m for p, m in kept]))
    assert f.step_model() == pytest.approx(want)
    again = RunFigures(window=3)
    again.load(f.to_json())
    assert again.step_model() == pytest.approx(want)

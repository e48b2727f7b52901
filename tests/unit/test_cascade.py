"""The cascade's rules (`runtime/server/cascade.py`), the shared device clock, and the
checked question set (`runtime/runs/questions.py`)."""

from __future__ import annotations

import json
import math
import re

import pytest

from kvdeck.runtime.errors import ConfigError, TraceError
from kvdeck.runtime.runs.loop import SharedBusy
from kvdeck.runtime.runs.questions import load_questions, read_costs
from kvdeck.runtime.server.cascade import CascadeConfig, CascadeStats, cascade_cost
from kvdeck.runtime.text.sampling import TokenLogprobs

SERVED = ["small", "large"]


def lp(p_sampled: float, p_top: float | None = None) -> TokenLogprobs:
    """A token sampled with probability `p_sampled`, the most likely one having `p_top`."""
    top = () if p_top is None else ((7, math.log(p_top)),)
    return TokenLogprobs(math.log(p_sampled), top)


def test_the_chapters_example_saves_about_seventy_percent() -> None:
    # Chapter 003: 80 % answered by a model ten times cheaper → cost 0.1 + 0.2 of the large.
    assert cascade_cost(0.2, 0.1) == pytest.approx(0.3)


def test_min_prob_is_the_least_sure_tokens_top_one_probability() -> None:
    c = CascadeConfig("small", "large", threshold=0.5)
    # The top-1 alternative is what counts (a sampled token may be less likely than it).
    assert c.confidence([lp(0.9, 0.9), lp(0.3, 0.6), lp(0.95, 0.95)]) == pytest.approx(0.6)
    assert c.confidence([lp(0.4)]) == pytest.approx(0.4)  # no alternatives: the sampled one
    assert c.confidence([]) == 0.0  # no tokens, nothing to trust


def test_mean_prob_is_the_geometric_mean_of_the_sampled_tokens() -> None:
    c = CascadeConfig("small", "large", measure="mean-prob")
    assert c.confidence([lp(0.8), lp(0.2)]) == pytest.approx(math.sqrt(0.8 * 0.2))


def test_routes_follow_the_threshold_and_the_check() -> None:
    c = CascadeConfig("small", "large", threshold=0.5)
    assert c.route(0.5, None) == "small"
    assert c.route(0.49, None) == "escalated-confidence"
    assert c.route(0.99, False) == "escalated-check"
    assert c.route(0.99, True) == "small"


@pytest.mark.parametrize(("threshold", "measure", "says"), [
    (1.5, "min-prob", "--cascade-threshold must be a probability from 0 to 1, got 1.5."),
    (-0.1, "min-prob", "--cascade-threshold must be a probability from 0 to 1, got -0.1."),
    (float("nan"), "min-prob", "--cascade-threshold must be a probability from 0 to 1"),
    (0.5, "entropy", "--cascade-confidence must be one of min-prob, mean-prob, got "
                     "'entropy'."),
])
def test_bad_knobs_get_one_sentence(threshold, measure, says) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        CascadeConfig("small", "large", threshold=threshold, measure=measure)


@pytest.mark.parametrize(("value", "says"), [
    ("small", "--cascade takes two served model names, small first, as SMALL,LARGE; got "
              "'small'."),
    ("small,huge", "--cascade names 'huge', which is not served; the served models are "
                   "small, large."),
    ("small,small", "--cascade needs two different models, got 'small' twice."),
])
def test_bad_cascades_get_one_sentence(value, says) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        CascadeConfig.parse(value, SERVED)


def test_the_cascade_name_may_not_hide_a_served_model() -> None:
    with pytest.raises(ConfigError, match="already a served model's"):
        CascadeConfig.parse("small,large", SERVED, name="large")


def test_stats_estimate_savings_from_the_escalated_pairs() -> None:
    stats = CascadeStats(CascadeConfig("small", "large"))
    assert stats.saved() is None  # nothing escalated yet: no measured cost ratio
    # Two answered by the small model (1 s each), one escalated: 1 s small + 3 s large.
    stats.record("small", 0.9, True, 1.0, 0.0, 1.0, 0.0)
    stats.record("small", 0.8, True, 1.0, 0.0, 1.0, 0.0)
    stats.record("escalated-confidence", 0.2, True, 1.0, 3.0, 1.0, 2.0)
    assert stats.requests == 3
    assert stats.escalation_rate == pytest.approx(1 / 3)
    assert stats.routes["escalated-confidence"].accelerator_s == 4.0
    # All-large would cost 3 s per request (9 s); the cascade spent 2 + 4 = 6 s.
    accel, latency = stats.saved()
    assert accel == pytest.approx(9.0 - 6.0)
    assert latency == pytest.approx(3 * 2.0 - 5.0)
    assert stats.confidence_counts[1] == 1 and stats.confidence_counts[7] == 1
    assert stats.confidence_counts[8] == 1


def test_shared_busy_counts_overlapping_steps_once() -> None:
    now = [0.0]
    busy = SharedBusy(clock=lambda: now[0])
    busy.begin()          # engine A steps from 0 ...
    now[0] = 1.0
    busy.begin()          # ... engine B from 1 ...
    now[0] = 3.0
    busy.end()            # ... A ends at 3 ...
    now[0] = 4.0
    assert busy.seconds == 4.0  # still busy: the ongoing span counts
    busy.end()            # ... B at 4: busy 0 → 4, not 3 + 3
    now[0] = 10.0
    busy.begin()
    now[0] = 10.5
    busy.end()
    assert busy.seconds == 4.5


def test_the_shipped_questions_load_and_their_own_answers_pass() -> None:
    questions = load_questions()
    assert len(questions) == 70
    assert all(q.check.kind == "regex" for q in questions)
    first = questions[0]
    answer = re.search(r"What is (\d+) \+ (\d+)\?", first.text)
    total = str(int(answer.group(1)) + int(answer.group(2)))
    assert first.check.passes(total) and first.check.passes(f" {total}.")
    assert not first.check.passes(total + "0")


@pytest.mark.parametrize(("text", "says"), [
    ("not json", "line 1: not JSON"),
    ('{"question": "q"}', 'line 1: each line needs a "question" string and a "check".'),
    ('{"question": "q", "check": {"regex": "("}}', "has a regex that does not compile"),
    ("\n", "holds no questions."),
])
def test_bad_question_files_get_one_sentence(tmp_path, text, says) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=re.escape(says)):
        load_questions(str(path))


def test_a_missing_question_file_is_named(tmp_path) -> None:
    with pytest.raises(TraceError, match="There is no question file"):
        load_questions(str(tmp_path / "none.jsonl"))


def test_costs_prefer_the_shared_device_clock() -> None:
    text = "\n".join([
        '# TYPE kvdeck:busy_seconds counter',
        'kvdeck:busy_seconds_total{model_name="a"} 2.0',
        'kvdeck:busy_seconds_total{model_name="b"} 3.0',
        '# TYPE kvdeck:cascade_requests counter',
        'kvdeck:cascade_requests_total{model_name="cascade",route="small"} 4.0',
        'kvdeck:cascade_requests_total{model_name="cascade",route="escalated-check"} 1.0',
    ]) + "\n"
    assert read_costs(text) == (5.0, {"small": 4.0, "escalated-check": 1.0})
    device = text + "# TYPE kvdeck:device_busy_seconds counter\n" \
                    "kvdeck:device_busy_seconds_total 4.5\n"
    assert read_costs(device)[0] == 4.5


def test_question_lines_are_the_apis_check_shape() -> None:
    from kvdeck.runtime.resources import QUESTIONS

    line = json.loads(QUESTIONS.read_text(encoding="utf-8").splitlines()[0])
    assert set(line) == {"question", "check"}


def test_the_routing_view_travels_through_metrics() -> None:
    """What `kvdeck attach` reads from a cascade server's /metrics is what the server's own
    console shows."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvdeck.runtime.server.cascade import CascadeView
    from kvdeck.runtime.server.metrics import CascadeCollector

    stats = CascadeStats(CascadeConfig("small", "large", threshold=0.6, measure="mean-prob"))
    stats.record("small", 0.95, True, 0.2, 0.0, 0.3, 0.0)
    stats.record("escalated-check", 0.8, False, 0.2, 0.5, 0.3, 0.6)
    stats.record("escalated-confidence", 0.15, True, 0.25, 0.7, 0.3, 0.9)
    registry = CollectorRegistry()
    registry.register(CascadeCollector(stats))
    read = CascadeView.from_metrics(generate_latest(registry).decode())
    here = stats.view()
    assert read.config == here.config
    assert read.routes == here.routes
    assert read.confidence_counts == here.confidence_counts
    assert read.escalation_rate == here.escalation_rate
    assert read.saved == pytest.approx(here.saved)
    assert CascadeView.from_metrics("# no cascade\n") is None

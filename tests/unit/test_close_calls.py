"""How near a predicted run came to a coin toss (`benchmarks/close_calls.py`)."""

import json
import math

import pytest

from benchmarks.close_calls import close_call_s
from kvdeck.runtime.runs.records import RUN_FORMAT

INTAKE = 0.04
PROMPT = 100


def step(t0: float, dt: float, plan: list, admitted=(), arrived=(), finished=()) -> dict:
    """A step record as `kvdeck run-trace --record` writes it (the fields read)."""
    return {"kind": "step", "step": 0, "t0": t0, "dt": dt, "plan": plan, "admitted": list(admitted),
            "arrived": [[rid, at, PROMPT, 8, None, 0] for rid, at in arrived],
            "finished": [[rid, "finished_length", "finished_length", t0 + dt]
                         for rid in finished]}


def prompt(rid: str, start: int = 0, n: int = 50) -> list:
    """A plan entry of `n` prompt tokens of `rid` from `start`."""
    return [rid, start, n, 0]


def decode(rid: str) -> list:
    """A plan entry of one decode row of `rid`, past its prompt."""
    return [rid, PROMPT, 1, 1]


def write(tmp_path, steps: list[dict]):
    """A run directory whose record is `steps` (its header: what `read_run` checks)."""
    (tmp_path / "header.json").write_text(json.dumps(
        {"kvdeck_run": RUN_FORMAT, "num_blocks": 1, "block_size": 16}))
    (tmp_path / "iterations.jsonl").write_text("".join(json.dumps(d) + "\n" for d in steps))
    return tmp_path


def test_a_request_that_rode_into_a_step_just_before_it_started_is_a_close_call(tmp_path):
    """The first request's wait (a hold) let the second in 0.2 ms before the step."""
    run = write(tmp_path, [step(1.0622, 0.6, [prompt("a"), prompt("b")], ("a", "b"),
                                (("a", 1.0), ("b", 1.022)))])
    assert close_call_s(run, INTAKE) == pytest.approx(0.0002)


def test_the_request_that_started_a_step_on_an_idle_engine_is_no_close_call(tmp_path):
    """Its step starts when it has come in (and the server's hold): nothing else sways it."""
    run = write(tmp_path, [step(1.0401, 0.6, [prompt("a")], ("a",), (("a", 1.0),))])
    assert close_call_s(run, INTAKE) == math.inf


def test_one_that_came_in_on_a_busy_engine_just_before_others_prompts_ran_is(tmp_path):
    """As in the Mooncake excerpt's later burst on llama-server: two requests' prompt
    pieces run in the next step, and a third came in just before it: a moment later, it
    waits out that whole step."""
    run = write(tmp_path, [
        step(1.05, 0.06, [prompt("a", 0, 1), prompt("b", 0, 1)], ("a", "b"),
             (("a", 1.0), ("b", 1.0))),
        step(1.11, 3.0, [prompt("a", 1, 50), prompt("b", 1, 50), prompt("c", 0, 1)], ("c",),
             (("c", 1.066),))])
    assert close_call_s(run, INTAKE) == pytest.approx(0.004)


def test_one_whose_prompt_is_the_steps_only_prompt_work_is_no_close_call(tmp_path):
    """Coming in just before the decode rows' next step, a moment later it runs its prompt
    a step later beside the same rows."""
    run = write(tmp_path, [
        step(1.02, 0.02, [decode("a")], (), (("a", 0.5),)),
        step(1.04, 0.3, [decode("a"), prompt("b")], ("b",), (("b", 0.9995),))])
    assert close_call_s(run, INTAKE) == math.inf


def test_a_request_that_came_in_just_after_a_prompt_step_started_is_a_close_call(tmp_path):
    run = write(tmp_path, [
        step(1.04, 0.6, [prompt("a")], ("a",), (("a", 1.0),)),
        step(1.64, 0.6, [prompt("a", 50), prompt("b")], ("b",), (("b", 1.003),))])
    assert close_call_s(run, INTAKE) == pytest.approx(0.003)


def test_steps_of_decode_rows_only_make_no_close_calls(tmp_path):
    """Coming in a moment before or after a decode step moves a request by one step."""
    run = write(tmp_path, [
        step(1.04, 0.02, [decode("a")], (), (("a", 0.5),)),
        step(1.06, 0.3, [decode("a"), prompt("b")], ("b",), (("b", 1.0005),))])
    assert close_call_s(run, INTAKE) == math.inf


def test_one_whose_prompt_stalls_another_requests_last_token_is(tmp_path):
    """A moment later, the other request's last token comes out in a decode step of its
    own, not after the prompt."""
    run = write(tmp_path, [
        step(1.02, 0.02, [decode("a")], (), (("a", 0.5),)),
        step(1.04, 0.3, [decode("a"), prompt("b")], ("b",), (("b", 0.9995),),
             finished=("a",))])
    assert close_call_s(run, INTAKE) == pytest.approx(0.0005)


def test_a_step_that_ran_nothing_and_a_request_never_seen_arriving_are_passed_over(tmp_path):
    """A record of a step that only took arrivals in has no plan; a fork's child is
    admitted without an arrival of its own."""
    run = write(tmp_path, [
        {"kind": "step", "step": 0, "t0": 1.0, "arrived": [["a", 0.96, PROMPT, 8, None, 0]]},
        step(1.0, 0.6, [prompt("a"), prompt("a.1")], ("a", "a.1"))])
    assert close_call_s(run, INTAKE) == math.inf

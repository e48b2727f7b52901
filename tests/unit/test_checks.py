"""Answer checks: what passes and fails each kind, the one sentence for a bad check, and a
checked request through a sim engine (with the stand-in tokenizer), its recording and
replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_record import Finished, StepRecord
from kvdeck.runtime.errors import RequestError, TraceError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.runs.recording import record_headless
from kvdeck.runtime.runs.replay import summarize_run
from kvdeck.runtime.stats.metrics import SLO
from kvdeck.runtime.text.checks import AnswerCheck, parse_check
from kvdeck.runtime.text.standin import StandInTokenizer


def deep(n: int) -> dict:
    """A schema of arrays nested `n` deep."""
    schema: dict = {}
    for _ in range(n):
        schema = {"items": schema}
    return schema


PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0}}}


def test_json_schema_check_parses_and_validates_the_answer() -> None:
    c = parse_check({"json_schema": PERSON})
    assert c.kind == "json_schema"
    assert c.passes('{"name": "Ada", "age": 36}')
    assert c.passes('\n {"name": "Ada", "age": 36}\n')  # JSON allows surrounding space
    assert not c.passes('{"name": "Ada", "age": -1}')  # schema violated
    assert not c.passes('{"name": "Ada", "age": 36, "x": 1}')
    assert not c.passes('{"name": "Ada", "age": 36')  # truncated: not JSON
    assert not c.passes("Sure! Here is the JSON: {}")
    assert not c.passes("[" * 100_000)  # deeper than the parser goes: fails, never raises
    local_ref = {"$defs": {"age": {"type": "integer"}}, "type": "object",
                 "properties": {"age": {"$ref": "#/$defs/age"}}}
    assert parse_check({"json_schema": local_ref}).passes('{"age": 3}')
    assert parse_check({"json_schema": deep(50)}).passes("[[[1]]]")
    assert not parse_check({"json_schema": local_ref}).passes('{"age": "3"}')
    recursive = parse_check({"json_schema": {"$ref": "#"}})  # valid, and never satisfied
    assert not recursive.passes("1")


def test_regex_must_match_the_whole_answer() -> None:
    c = parse_check({"regex": r"\s*(yes|no)\.?"})
    assert c.passes(" yes.") and c.passes("no")
    assert not c.passes("yes, and more")  # a prefix match is not enough
    assert not c.passes("I say no")  # nor a match inside
    assert not c.passes("YES")
    assert AnswerCheck("regex", r"\d+").passes("2024")


def test_expected_answer_ignores_surrounding_whitespace_only() -> None:
    c = parse_check({"expected": "Paris"})
    assert c.passes(" Paris\n") and c.passes("Paris")
    assert not c.passes("paris") and not c.passes("Paris.") and not c.passes("Par is")


def test_checks_round_trip_through_their_json_shape() -> None:
    for shape in ({"json_schema": PERSON}, {"regex": "a+"}, {"expected": " 42 "}):
        c = parse_check(shape)
        assert c.to_json() == shape and parse_check(json.loads(json.dumps(c.to_json()))) == c


@pytest.mark.parametrize("shape, sentence", [
    ({"regex": "(ab"}, "The check has a regex that does not compile (missing ) at position "
     "3); patterns use Python's re syntax."),
    ({"json_schema": {"type": "integr"}}, "The check has a json_schema that is not a valid "
     "JSON Schema: 'integr' is not valid under any of the given schemas (at $.type)."),
    ({"json_schema": {"properties": {"a": {"minimum": "zero"}}}}, "The check has a "
     "json_schema that is not a valid JSON Schema: 'zero' is not of type 'number' (at "
     "$.properties.a.minimum)."),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, "The check has a json_schema whose $ref "
     "'#/$defs/missing' points nowhere; references must point inside the schema."),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, "The check has a json_schema "
     "whose $ref 'https://example.com/s.json' points nowhere; references must point inside "
     "the schema."),
    ({"json_schema": {"$schema": "https://example.com/my-dialect"}}, "The check has a "
     "json_schema whose $schema 'https://example.com/my-dialect' names no dialect this "
     "kvdeck knows; leave it out (draft 2020-12) or name draft 4, 6, 7, 2019-09 or 2020-12."),
    ({"json_schema": {"type": "string", "pattern": "(?<=a+)b"}}, "The check has a json_schema "
     "that is not a valid JSON Schema: '(?<=a+)b' is not a 'regex' (at $.pattern)."),
    ({"json_schema": deep(2_000)}, "The check has a json_schema nested too deeply to check."),
    ({"json_schema": deep(600)}, "The check has a json_schema nested too deeply to check."),
    ({"json_schema": "object"}, "The check has a json_schema that is not a JSON object; a "
     "schema is an object such as {\"type\": \"object\"}."),
    ({"expected": 42}, "The check has expected 42, which is not a string."),
    ({"regex": "a", "expected": "a"}, "The check must be an object with exactly one of the "
     "keys json_schema, regex or expected, got {\"regex\": \"a\", \"expected\": \"a\"}."),
    ({"contains": "a"}, "The check must be an object with exactly one of the keys "
     "json_schema, regex or expected, got {\"contains\": \"a\"}."),
])
def test_a_bad_check_is_one_sentence_naming_the_problem(shape, sentence: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_check(shape)
    assert str(err.value) == sentence


def test_a_bad_check_names_where_it_came_from() -> None:
    with pytest.raises(TraceError, match=r"^The check on t.jsonl line 3 has a regex that "
                                         r"does not compile \(nothing to repeat"):
        parse_check({"regex": "*"}, where="The check on t.jsonl line 3", error=TraceError)
    with pytest.raises(RequestError, match=r"^The check has kind 'contains'; kinds are "
                                           r"json_schema, regex, expected\.$"):
        AnswerCheck("contains", "x")


def sim_engine(seed: int = 3) -> Engine:
    executor = SimExecutor(SimConfig(), seed=seed)
    return Engine(EngineConfig(block_size=8, num_blocks=64, seed=seed), executor,
                  tokenizer=StandInTokenizer(executor.info.vocab_size,
                                             executor.config.eos_token_id))


def test_the_engine_marks_finished_answers_correct_or_not(tmp_path: Path) -> None:
    """The sim's stand-in words: the same answer for the same seed and request id, so an
    expected answer read from one engine passes on another; the flag reaches the request,
    the figures, the step record, the summary and the recording's replay."""
    first = sim_engine()
    probe = first.add_request([5, 6, 7], SamplingParams(max_tokens=5), request_id="same")
    first.run_until_idle()
    answer = probe.output_text
    assert len(answer.split()) == 5

    engine = sim_engine()
    record_headless(engine, tmp_path / "run")
    words = parse_check({"regex": r"\s*[a-z]+( [a-z]+)*\s*"})
    checks = {"same": parse_check({"expected": answer}), "words": words,
              "digits": parse_check({"regex": r"\d+"}), "plain": None,
              "json": parse_check({"json_schema": {"type": "object"}})}
    reqs = {rid: engine.add_request([5, 6, 7], SamplingParams(max_tokens=5), request_id=rid,
                                    check=c) for rid, c in checks.items()}
    records = []
    while engine.has_work:
        rec = engine.step()
        if rec is not None:
            records.append(rec)
        engine.check_integrity()
    engine.recorder.close()
    assert reqs["same"].output_text == answer
    assert {rid: r.correct for rid, r in reqs.items()} == \
        {"same": True, "words": True, "digits": False, "plain": None, "json": False}
    f = engine.figures
    assert (f.num_checked, f.num_check_failures, f.num_good) == (4, 2, 3)
    finished = {x.request_id: x.correct for r in records for x in r.finished}
    assert finished == {rid: r.correct for rid, r in reqs.items()}
    replayed = summarize_run(tmp_path / "run", SLO())
    assert (replayed["num_checked"], replayed["num_correct"], replayed["num_good"]) == (4, 2, 3)


def test_an_engine_without_a_tokenizer_refuses_a_check() -> None:
    executor = SimExecutor(SimConfig(), seed=0)
    engine = Engine(EngineConfig(block_size=8, num_blocks=16), executor)
    with pytest.raises(RequestError, match="^Answer checks read the answer's text, which "
                                           "needs a tokenizer, and this engine has none.$"):
        engine.add_request([1, 2], check=parse_check({"regex": "x"}))


def test_step_records_write_the_flag_only_where_checked() -> None:
    """Runs recorded before checks (four fields per finish) read as unchecked, and a run
    without checks writes exactly what it wrote before."""
    old = StepRecord.from_json({"step": 3, "t0": 1.0, "finished": [["a", "finished_length",
                                                                    None, 2.0]]}, "old")
    assert old.finished == [Finished("a", "finished_length", None, 2.0, None)]
    rec = StepRecord(4, finished=[Finished("a", "finished_stopped", None, 2.0),
                                  Finished("b", "finished_length", None, 2.0, False)])
    d = rec.to_json()
    assert d["finished"] == [["a", "finished_stopped", None, 2.0],
                             ["b", "finished_length", None, 2.0, False]]
    assert StepRecord.from_json(d, "new").finished == rec.finished


def test_a_pattern_that_backtracks_forever_fails_in_bounded_time() -> None:
    """A client's pattern runs on the engine thread: past its time limit the answer fails
    its check, whether the pattern is the check or inside its schema."""
    evil = "(a|aa)+c"
    text = "a" * 40  # exponentially many ways to split it: runs out of time
    assert not AnswerCheck("regex", evil).passes(text)
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": evil}},
              "patternProperties": {evil: {"type": "string"}}}
    check = AnswerCheck("json_schema", json.dumps(schema))
    assert not check.passes(json.dumps({"x": text}))
    # A key the pattern cannot be decided on in time is taken as not matching it: the
    # object is then valid (no other keyword constrains that key), and the check returns.
    assert check.passes(json.dumps({text: 1}))
    assert AnswerCheck("regex", r"\d+").passes("123")

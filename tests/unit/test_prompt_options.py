"""The console prompt line's leading options."""

from __future__ import annotations

import json

import pytest

from kvdeck.console.prompt_options import parse_prompt
from kvdeck.runtime.errors import RequestError


def test_options_then_the_prompt() -> None:
    o = parse_prompt('n=3 temp=0.7 seed=9 json={"type": "object", "required": ["a"]} '
                     'Give me JSON. n=2 stays text')
    assert (o.n, o.temperature, o.seed) == (3, 0.7, 9)
    assert o.guide.kind == "json_schema"
    assert json.loads(o.guide.source) == {"type": "object", "required": ["a"]}
    assert o.text == "Give me JSON. n=2 stays text"
    o = parse_prompt(r"regex=\d{3}-\d{4} Call me")
    assert (o.guide.kind, o.guide.source, o.text) == ("regex", r"\d{3}-\d{4}", "Call me")
    o = parse_prompt("choice=red|green|blue Pick a colour")
    assert json.loads(o.guide.source) == ["red", "green", "blue"]
    plain = parse_prompt("  Just a prompt  ")
    assert (plain.text, plain.n, plain.temperature, plain.guide) == ("Just a prompt", 1, 0.0,
                                                                     None)


@pytest.mark.parametrize("line, sentence", [
    ("n=0 hi", "n= must be a whole number from 1 to 64, got '0'."),
    ("n=x hi", "n= must be a whole number from 1 to 64, got 'x'."),
    ("temp=hot hi", "temp= must be a number from 0 to 2, got 'hot'."),
    ("temp=nan hi", "temp= must be a number from 0 to 2, got 'nan'."),
    ("seed=1.5 hi", "seed= must be a whole number, got '1.5'."),
    ("json={oops hi", "json= needs a JSON schema right after it"),
    ("json=[1] hi", "json= needs a JSON schema object"),
    ("choice=a||b hi", "choice strings must not be empty."),
    ("regex=a choice=b hi", "A prompt takes one of json=, regex= and choice=."),
])
def test_a_bad_option_is_one_sentence(line, sentence) -> None:
    with pytest.raises(RequestError) as e:
        parse_prompt(line)
    assert str(e.value).startswith(sentence)

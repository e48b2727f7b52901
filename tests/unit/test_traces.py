"""Arrival-trace parsers on the real public traces and on malformed files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.runtime.errors import TraceError
from kvdeck.runtime.runs.trace import Arrival, load_arrivals, synthesize_tokens
from tests.paths import AZURE_CODE, AZURE_CONV, MOONCAKE


def test_azure_conv_whole_file() -> None:
    arrivals = load_arrivals(AZURE_CONV)
    assert len(arrivals) == 1_000  # traces/README.md: 1,000 requests over 216 s
    assert arrivals[0].arrival_s == 0.0
    assert 215 < arrivals[-1].arrival_s < 217
    mean_ctx = sum(a.prompt_len for a in arrivals) / len(arrivals)
    assert mean_ctx == pytest.approx(1_014.189)  # README: mean context 1,014
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(arrivals, arrivals[1:], strict=False))


def test_azure_code_and_time_scale() -> None:
    full = load_arrivals(AZURE_CODE, limit=100)
    fast = load_arrivals(AZURE_CODE, limit=100, time_scale=0.5)
    assert len(full) == 100
    assert fast[-1].arrival_s == pytest.approx(full[-1].arrival_s * 0.5)


def test_mooncake_hash_ids_become_shared_token_prefixes() -> None:
    arrivals = load_arrivals(MOONCAKE, limit=200)
    assert len(arrivals) == 200
    for a in arrivals:
        assert a.hash_ids is not None and len(a.hash_ids) == -(-a.prompt_len // 512)
    # The first records all start with hash id 0: identical first 512 tokens.
    t = [synthesize_tokens(a, i, 32_000) for i, a in enumerate(arrivals[:3])]
    assert all(len(x) == a.prompt_len for x, a in zip(t, arrivals[:3], strict=True))
    assert t[0][:512] == t[1][:512] == t[2][:512]
    assert t[0][512:1024] != t[1][512:1024]  # different second hash ids
    # Same ids at the same positions across the trace give the same tokens.
    same = [(i, a) for i, a in enumerate(arrivals) if a.hash_ids[:2] == arrivals[0].hash_ids[:2]]
    for i, a in same[1:]:
        assert synthesize_tokens(a, i, 32_000)[:1024] == t[0][:1024]


def test_own_jsonl_with_prefix_groups(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"arrival_s": 0.5, "prompt_len": 40, "output_len": 3, "prefix_group": "sys", '
        '"prefix_len": 32, "deadline_s": 7, "priority": 1, "id": "x"}\n'
        '\n'
        '{"arrival_s": 0.25, "prompt_tokens": [5, 6, 7], "output_len": 2}\n'
        '{"arrival_s": 1.0, "prompt_len": 50, "prefix_group": "sys", "prefix_len": 32}\n'
    )
    a = load_arrivals(p)
    assert [x.arrival_s for x in a] == [0.0, 0.25, 0.75]  # relative to the first, sorted
    assert a[0].prompt_tokens == (5, 6, 7) and a[0].output_len == 2
    assert a[1].request_id == "x" and a[1].deadline_s == 7.0 and a[1].priority == 1
    assert a[2].output_len == 16  # default
    t1, t2 = synthesize_tokens(a[1], 1, 1000), synthesize_tokens(a[2], 2, 1000)
    assert t1[:32] == t2[:32] and t1[32:] != t2[32:40]
    # to_json round-trips through the parser.
    p2 = tmp_path / "round.jsonl"
    p2.write_text("\n".join(__import__("json").dumps(x.to_json()) for x in a))
    assert load_arrivals(p2) == a


def test_own_jsonl_carries_answer_checks(tmp_path: Path) -> None:
    p = tmp_path / "checked.jsonl"
    p.write_text(
        '{"arrival_s": 0, "prompt_tokens": [5, 6], "check": {"expected": "Paris"}}\n'
        '{"arrival_s": 1, "prompt_len": 9, "check": {"regex": "\\\\d+"}}\n'
        '{"arrival_s": 2, "prompt_len": 9, "check": {"json_schema": {"type": "array"}}}\n'
        '{"arrival_s": 3, "prompt_len": 9}\n')
    a = load_arrivals(p)
    assert [x.check.to_json() if x.check else None for x in a] == [
        {"expected": "Paris"}, {"regex": "\\d+"}, {"json_schema": {"type": "array"}}, None]
    assert a[1].check.passes("2024") and not a[2].check.passes("{}")
    p2 = tmp_path / "round.jsonl"
    p2.write_text("\n".join(__import__("json").dumps(x.to_json()) for x in a))
    assert load_arrivals(p2) == a


@pytest.mark.parametrize("name, content, message", [
    ("re.jsonl", '{"arrival_s": 0, "prompt_len": 5}\n'
     '{"arrival_s": 1, "prompt_len": 5, "check": {"regex": "(a"}}\n',
     "The check on " + "{dir}/re.jsonl line 2 has a regex that does not compile (missing ) at "
     "position 2); patterns use Python's re syntax."),
    ("schema.jsonl", '{"arrival_s": 0, "prompt_len": 5, "check": {"json_schema": '
     '{"type": 5}}}\n', "line 1 has a json_schema that is not a valid JSON Schema: 5 is "
     "not valid under any of the given schemas (at $.type)."),
    ("two.jsonl", '{"arrival_s": 0, "prompt_len": 5, "check": {"regex": "a", '
     '"expected": "a"}}\n', "two.jsonl line 1 must be an object with exactly one of the "
     "keys json_schema, regex or expected"),
    ("text.jsonl", '{"arrival_s": 0, "prompt_len": 5, "check": "Paris"}\n',
     "text.jsonl line 1 must be an object with exactly one of the keys json_schema, regex "
     "or expected, got \"Paris\"."),
])
def test_malformed_checks_name_line_and_problem(tmp_path: Path, name: str, content: str,
                                                message: str) -> None:
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(TraceError) as err:
        load_arrivals(p)
    assert message.replace("{dir}", str(tmp_path)) in str(err.value)


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", '{"arrival_s": 0, "prompt_len": 5}\n{oops\n',
     "bad.jsonl line 2 is not valid JSON"),
    ("neg.jsonl", '{"arrival_s": -1, "prompt_len": 5}\n',
     "neg.jsonl line 1 has arrival_s=-1; it must be a number ≥ 0."),
    ("nolen.jsonl", '{"arrival_s": 0}\n', "nolen.jsonl line 1 lacks 'prompt_len'."),
    ("toks.jsonl", '{"arrival_s": 0, "prompt_tokens": ["a"]}\n',
     "toks.jsonl line 1 has prompt_tokens that are not a non-empty list"),
    ("moon.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}\n',
     "moon.jsonl line 1 has hash_ids that are not a list of integers."),
    ("head.csv", "time,ctx,gen\n", "head.csv line 1 must be the header "
     "TIMESTAMP,ContextTokens,GeneratedTokens."),
    ("row.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n",
     "row.csv line 2 has non-integer token counts"),
    ("when.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n",
     "when.csv line 2 has TIMESTAMP 'yesterday'"),
    ("empty.jsonl", "\n\n", "empty.jsonl is empty; a trace needs at least one request."),
])
def test_malformed_traces_name_line_and_problem(tmp_path: Path, name: str, content: str,
                                                message: str) -> None:
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(TraceError) as err:
        load_arrivals(p)
    assert message in str(err.value)


def test_missing_file_and_bad_format(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        load_arrivals(tmp_path / "none.jsonl")
    with pytest.raises(TraceError, match="Unknown trace format 'parquet'"):
        load_arrivals(AZURE_CODE, "parquet")


def test_arrival_defaults() -> None:
    a = Arrival(0.0, 4, 2)
    assert synthesize_tokens(a, 0, 50) == synthesize_tokens(a, 0, 50)
    assert synthesize_tokens(a, 0, 50) != synthesize_tokens(a, 1, 50)
    assert all(3 <= t < 50 for t in synthesize_tokens(a, 0, 50))


def test_sample_traces_by_name() -> None:
    # The shipped excerpts are found by name, wherever kvdeck is installed.
    for name, count in (("azure-conv", 1_000), ("azure-code", 500),
                        ("mooncake-conversation", 500)):
        assert len(load_arrivals(name)) == count
    with pytest.raises(TraceError, match="sample traces are azure-conv, azure-code, "
                                         "mooncake-conversation"):
        load_arrivals("azure-chat")

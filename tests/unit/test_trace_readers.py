"""The traces the field publishes, read as their formats are written: Bailian (seconds,
16-token blocks, sessions from chat parents), BurstGPT (CSV), AIPerf's mooncake_trace
(sessions, delays), and staged workloads. The lines follow each format's documentation
(no excerpt of these traces can be fetched here)."""

from __future__ import annotations

import json

import pytest

from kvdeck.runtime.errors import TraceError
from kvdeck.runtime.runs.trace import detect_format, load_arrivals, synthesize_tokens


def write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return p


def test_bailian_sessions_blocks_and_seconds(tmp_path):
    p = write(tmp_path, "bailian.jsonl", [
        {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 40,
         "output_length": 132, "type": "text", "turn": 1, "hash_ids": [7, 8, 9]},
        {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 70,
         "output_length": 80, "type": "text", "turn": 2, "hash_ids": [7, 8, 9, 10, 11]},
        {"chat_id": 170, "timestamp": 63.0, "input_length": 20, "output_length": 0},
    ])
    assert detect_format(p) == "bailian"
    a, b, c = load_arrivals(p)
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, pytest.approx(1.386),
                                                        pytest.approx(1.886))
    assert a.session == b.session == "c159" and c.session == "c170"
    assert a.hash_block_tokens == 16 and c.output_len == 1
    # The second turn's first 48 tokens are the first turn's three 16-token blocks.
    ta, tb = synthesize_tokens(a, 0, 1000), synthesize_tokens(b, 1, 1000)
    assert len(ta) == 40 and tb[:40] == ta[:40] and len(tb) == 70


def test_bailian_turn_without_its_first_is_named(tmp_path):
    p = write(tmp_path, "bailian.jsonl", [
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 1.0, "input_length": 4,
         "output_length": 1}])
    with pytest.raises(TraceError, match="continues chat 1, which no earlier line starts"):
        load_arrivals(p)


def test_burstgpt_csv(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n"
                 "45,ChatGPT,1087,0,1087,Conversation log\n")
    assert detect_format(p) == "burstgpt"
    a, b = load_arrivals(p)
    assert (a.arrival_s, a.prompt_len, a.output_len) == (0.0, 472, 18)
    assert (b.arrival_s, b.prompt_len, b.output_len) == (40.0, 1087, 1)
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,x,18,490,Conversation log\n")
    with pytest.raises(TraceError, match="line 2 has a Timestamp or token count"):
        load_arrivals(p)


def test_aiperf_mooncake_trace_sessions_and_delays(tmp_path):
    p = write(tmp_path, "aiperf.jsonl", [
        {"session_id": "s1", "timestamp": 1000, "input_length": 600, "output_length": 10,
         "hash_ids": [1, 2]},
        {"session_id": "s2", "timestamp": 1500, "input_length": 100, "output_length": 5},
        {"session_id": "s1", "delay": 2000, "input_length": 1200, "output_length": 10,
         "hash_ids": [1, 2, 3]},
    ])
    assert detect_format(p) == "aiperf"
    a, b, c = load_arrivals(p)
    assert [x.arrival_s for x in (a, b, c)] == [0.0, 0.5, 2.0]
    assert a.session == c.session == "s1" and a.hash_block_tokens == 512
    assert synthesize_tokens(c, 2, 1000)[:600] == synthesize_tokens(a, 0, 1000)


def test_staged_workload_shares_system_prompts_and_questions():
    arrivals = load_arrivals("llm-d-shared-prefix")
    assert len(arrivals) == 3 * 50 + 10 * 50 + 15 * 50 + 20 * 50
    assert arrivals[1].arrival_s - arrivals[0].arrival_s == pytest.approx(1 / 3)
    first = synthesize_tokens(arrivals[0], 0, 32000)
    assert len(first) == 9000
    same_group = [a for a in arrivals if a.hash_ids[0] == arrivals[0].hash_ids[0]]
    other = synthesize_tokens(same_group[1], 1, 32000)
    assert other[:8000] == first[:8000]


def test_vllm_timed_trace_with_its_settings(tmp_path):
    p = write(tmp_path, "moon.jsonl", [
        {"ts": 0, "in": 1100, "out": 20, "ids": [1, 2, 3]},
        {"ts": 2500, "in": 1100, "out": 20, "ids": [1, 2, 4]},
    ])
    a, b = load_arrivals(p, "timed-trace:chunk_hash_size=512,sec_multiplier=0.001,"
                            "label_timestamp=ts,label_input_length=in,label_output_length=out,"
                            "label_hash_ids=ids")
    assert (a.arrival_s, b.arrival_s) == (0.0, 2.5)
    assert a.hash_block_tokens == 512
    ta, tb = synthesize_tokens(a, 0, 1000), synthesize_tokens(b, 1, 1000)
    assert ta[:1024] == tb[:1024] and ta[1024:] != tb[1024:]
    # vLLM's defaults: Mooncake's field names, seconds, 16-token chunks.
    q = write(tmp_path, "plain.jsonl", [{"timestamp": 3, "input_length": 40,
                                         "output_length": 2, "hash_ids": [5, 6]}])
    (c,) = load_arrivals(q, "timed-trace")
    assert c.hash_block_tokens == 16
    for fmt, said in (("timed-trace:chunk_hash_size=0", "chunk_hash_size must be a whole"),
                      ("timed-trace:depth=2", "--format timed-trace takes chunk_hash_size"),
                      ("mooncake:x=1", "Only --format timed-trace takes options")):
        with pytest.raises(TraceError, match=said):
            load_arrivals(q, fmt)

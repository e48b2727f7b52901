"""Answer checks through the API: kvdeck's `check` field from the official `openai` client
moves /metrics' goodput and check counters, a bad check is a 400 with one sentence, and
`kvdeck bench --retries` re-sends answers that fail their check until one passes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdeck.runtime.runs.loadgen import attempt_seed
from kvdeck.runtime.server.serve import ApiServer
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from tests.servers import idle, in_process, sim_in_process

COUNTERS = ("kvdeck:goodput_requests_total", "kvdeck:checked_requests_total",
            "kvdeck:check_failures_total")
WORDS = r"\s*[a-z]+( [a-z]+)*\s*"
"""What the sim's stand-in tokenizer answers: lower-case pseudo-words, one per token."""


def counters(server: ApiServer) -> dict[str, float]:
    idle(server)
    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {name: found[name] for name in COUNTERS}


def moved(before: dict[str, float], after: dict[str, float]) -> tuple[float, ...]:
    return tuple(after[k] - before[k] for k in COUNTERS)


@pytest.fixture(scope="module")
def sim() -> Iterator[ApiServer]:
    with sim_in_process() as srv:
        yield srv


def test_checks_from_the_openai_client_move_goodput_and_failures(sim: ApiServer) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sim.port}/v1", api_key="none",
                           max_retries=0)
    before = counters(sim)
    passed = client.completions.create(model="sim", prompt="Name a colour", max_tokens=5,
                                       extra_body={"check": {"regex": WORDS}})
    assert len(passed.choices[0].text.split()) == 5
    wrong = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "Capital of France?"}],
        max_tokens=4, extra_body={"check": {"expected": "Paris"}})
    assert wrong.choices[0].message.content.strip() != "Paris"  # a wrong answer is answered
    streamed = client.completions.create(
        model="sim", prompt="Reply in JSON", max_tokens=6, stream=True,
        extra_body={"check": {"json_schema": {"type": "object"}}})
    assert "".join(c.choices[0].text for c in streamed if c.choices).strip()
    client.completions.create(model="sim", prompt="No check here", max_tokens=3)
    goodput, checked, failures = moved(before, counters(sim))
    # Four finished: the unchecked one and the passing one are good; two failed.
    assert (goodput, checked, failures) == (2, 3, 2)


@pytest.mark.parametrize("check, sentence", [
    ({"regex": "(unclosed"}, "'check' has a regex that does not compile (missing ) at "
     "position 9); patterns use Python's re syntax."),
    ({"json_schema": {"type": "objekt"}}, "'check' has a json_schema that is not a valid JSON "
     "Schema: 'objekt' is not valid under any of the given schemas (at $.type)."),
    ({"regex": "a", "expected": "a"}, "'check' must hold exactly one of json_schema, regex or "
     "expected."),
    ({}, "'check' must hold exactly one of json_schema, regex or expected."),
    ({"contains": "a"}, "'check.contains' is not a field this endpoint takes."),
    ({"expected": 42}, "'check.expected' must be a string."),
    ("Paris", "'check' must be an object."),
])
def test_a_bad_check_is_a_400_with_one_sentence(sim: ApiServer, check, sentence: str) -> None:
    before = counters(sim)
    r = httpx.post(f"http://127.0.0.1:{sim.port}/v1/completions",
                   json={"model": "sim", "prompt": "Hi", "max_tokens": 2, "check": check})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == sentence
    assert r.json()["error"]["param"].startswith("check")
    assert moved(before, counters(sim)) == (0, 0, 0)


@pytest.fixture(scope="module")
def gemma(gemma_path) -> Iterator[ApiServer]:
    with in_process(build_session(resolve({
            "model": str(gemma_path), "device": "cpu", "served_model_name": "gemma3-270m",
            "kv_memory_bytes": 128 << 20}), live=True)) as srv:
        yield srv


@pytest.mark.slow
def test_bench_retries_until_the_answer_passes_its_check(gemma: ApiServer,
                                                         tmp_path: Path) -> None:
    """Sampled answers (temperature 1, a seed per send) of the real Gemma 3 270M: the test
    reads what each send of request 0 answers, expects the latest new one, and bench must
    find it after exactly that many retries; a request whose
    check no answer passes is sent 1 + retries times and never counts as good; an unchecked
    one is good at once. With --send-checks the server counts the same."""
    base = f"http://127.0.0.1:{gemma.port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    prompt = httpx.post(base + "/tokenize", json={"prompt": "My favourite animal is"}
                        ).json()["tokens"]
    answers = [client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=3,
                                         temperature=1.0, seed=attempt_seed(0, k)
                                         ).choices[0].text.strip() for k in range(4)]
    # The latest send whose answer no earlier send gave: with 3 retries, the last one.
    wanted = max(k for k in range(1, 4) if answers[k] not in answers[:k])
    trace = tmp_path / "checked.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"arrival_s": 0, "prompt_tokens": prompt, "output_len": 3, "id": "found",
         "check": {"expected": answers[wanted]}},
        {"arrival_s": 0, "prompt_tokens": prompt, "output_len": 3, "id": "never",
         "check": {"regex": "☃+"}},
        {"arrival_s": 0, "prompt_tokens": prompt, "output_len": 3, "id": "plain"},
    ]) + "\n")
    before = counters(gemma)
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "bench", str(trace), "--url",
                        base + "/v1", "--model", "gemma3-270m", "--retries", "3",
                        "--temperature", "1", "--concurrency", "1", "--send-checks",
                        "--no-warmup", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    s = result["summary"]
    sends = {m["request_id"]: m for m in result["requests"]}
    assert set(sends) == {"found", *(f"found.retry{k}" for k in range(1, wanted + 1)),
                          "never", *(f"never.retry{k}" for k in range(1, 4)), "plain"}
    assert [sends[f"found.retry{k}" if k else "found"]["correct"]
            for k in range(wanted + 1)] == [False] * wanted + [True]
    assert sends["plain"]["correct"] is None
    assert (s["trace_requests"], s["retries"], s["answered_correctly"]) == (3, wanted + 3, 2)
    assert (s["num_checked"], s["num_correct"], s["num_good"]) == (wanted + 5, 1, 2)
    assert s["num_requests"] == wanted + 6 and s["time_to_correct_s"]["count"] == 2
    # Found's time to a correct answer runs from its first send to the end of the one that
    # passed, across every send between; plain's is its one send's.
    found = [sends[f"found.retry{k}" if k else "found"] for k in range(wanted + 1)]
    to_correct = found[-1]["finish"] - found[0]["arrival"]
    assert 2 * s["time_to_correct_s"]["mean"] - sends["plain"]["e2e"] == \
        pytest.approx(to_correct)
    assert to_correct >= sum(m["e2e"] for m in found)
    goodput, checked, failures = moved(before, counters(gemma))
    assert (goodput, checked, failures) == (2, wanted + 5, wanted + 4)

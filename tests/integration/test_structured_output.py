"""Structured output through the OpenAI-compatible server on Gemma 3 270M, driven by the
official `openai` client: JSON schemas (chat and completions, whole and streamed), JSON
objects, choices, regexes and grammars, and one sentence for a constraint that cannot be
compiled."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.integration.test_server import MODEL, gemma_session
from tests.servers import in_process, sim_process

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "teacher", "doctor", "artist"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "country": {"type": "string", "maxLength": 20},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                  "minItems": 1, "maxItems": 3},
    "coastal": {"type": "boolean"}},
    "required": ["city", "country", "landmarks", "coastal"], "additionalProperties": False}
RECIPE = {"type": "object", "properties": {
    "dish": {"type": "string", "maxLength": 24},
    "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
    "steps": {"type": "array", "items": {"type": "string", "maxLength": 32},
              "minItems": 2, "maxItems": 4}},
    "required": ["dish", "minutes", "steps"], "additionalProperties": False}
PROMPTS = [
    (PERSON, "Describe a software engineer from Berlin."), (PERSON, "Invent a teacher."),
    (PERSON, "Who painted the Mona Lisa?"), (PERSON, "Describe your doctor."),
    (PERSON, "A character from a fairy tale."), (PERSON, "Tell me about a retired pilot."),
    (PERSON, "Describe a child who loves drawing."),
    (CITY, "Tell me about Paris."), (CITY, "Describe Tokyo."), (CITY, "A city in Brazil."),
    (CITY, "Where is the Colosseum?"), (CITY, "Describe a mountain town in Switzerland."),
    (CITY, "What is the capital of Australia?"),
    (RECIPE, "How do I make pancakes?"), (RECIPE, "A quick pasta dinner."),
    (RECIPE, "How to bake bread."), (RECIPE, "Make a green salad."),
    (RECIPE, "Boil an egg."), (RECIPE, "A chocolate cake recipe."),
    (RECIPE, "Tea, the British way."),
]


@pytest.fixture(scope="module")
def server(gemma_path):
    with in_process(gemma_session(gemma_path, kv_memory_bytes=256 << 20)) as srv:
        yield srv


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                         max_retries=0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                    "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_always_validate(client, stream) -> None:
    """Twenty schema-bound answers, eight in flight at a time as a client would send them:
    constrained requests decode in one batch, each under its own grammar."""
    assert len(PROMPTS) == 20

    def ask(i: int) -> None:
        schema, prompt = PROMPTS[i]
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                  "max_tokens": 160, "response_format": schema_format(schema),
                  "temperature": 0.7 if i % 2 else 0.0, "seed": i}
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", (prompt, text)
        jsonschema.validate(json.loads(text), schema)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(len(PROMPTS))))  # re-raises the first failure


def test_completions_take_a_schema_and_json_object(client) -> None:
    r = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=80,
                                  temperature=0, extra_body={"response_format":
                                                             schema_format(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    # Any JSON object: nothing bounds it, so the prompt asks for a short one.
    prompt = 'The JSON {"ok": true} means success. Reply with that JSON:'
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=60,
        temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content)["ok"] is True
    r = client.completions.create(model=MODEL, prompt="A recipe:", max_tokens=160,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"json": RECIPE}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), RECIPE)


def test_choice_returns_only_the_choices(client) -> None:
    choices = ["positive", "negative", "neutral"]
    seen = set()
    for seed in range(8):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Classify: I love this film!"}],
            max_tokens=10, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
        seen.add(r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=5,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def test_regex_and_grammar(client) -> None:
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r = client.completions.create(model=MODEL, prompt="Today's date is", max_tokens=20,
                                  temperature=0.9, seed=3,
                                  extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(date, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /[0-9]+/'
    r = client.completions.create(model=MODEL, prompt="What is 6 times 7?", max_tokens=20,
                                  temperature=0, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].text)
    gbnf = 'root ::= "(" [a-z]+ ")"'
    r = client.completions.create(model=MODEL, prompt="A word in brackets:", max_tokens=20,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"\([a-z]+\)", r.choices[0].text)


@pytest.mark.parametrize("extra, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "cannot be compiled"),
    ({"structured_outputs": {"choice": []}}, None, "at least one string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None, "one output constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"guided_json": 5}, "guided_json", "must be"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json", "must be an object"),
])
def test_a_bad_constraint_is_400_with_one_sentence(server, extra, param, needle) -> None:
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    r = httpx.post(url, json=body | extra, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param
    assert err["message"].endswith(".") and "\n" not in err["message"]
    ok = httpx.post(url, json=body, timeout=60)  # and the server goes on
    assert ok.status_code == 200


def test_the_sim_refuses_constraints_in_one_sentence() -> None:
    with sim_process() as server:
        model = httpx.get(f"{server.url}/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"{server.url}/completions", timeout=30, json={
            "model": model, "prompt": "hi", "max_tokens": 4,
            "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "needs a real model" in r.json()["error"]["message"]


def test_a_schema_answer_cut_short_fails_its_check(server, client) -> None:
    """A json_schema constraint is also the answer's check: one that max_tokens cuts off is
    finished but not good (/metrics' check counters and goodput say so)."""
    from tests.integration.test_checks_server import counters, moved

    before = counters(server)
    for max_tokens in (4, 160):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a teacher."}],
            max_tokens=max_tokens, temperature=0, response_format=schema_format(PERSON))
    good, checked, failed = moved(before, counters(server))
    assert (checked, failed) == (2, 1) and good <= 1


@pytest.mark.parametrize("depth", [300, 5000])
def test_a_schema_nested_too_deeply_is_400(server, depth) -> None:
    """Deeper than the server's encoders recurse (a body parser may take it): one
    sentence, and the server goes on."""
    schema = '{"type": "object", "properties": {"x": ' * depth + "{}" + "}}" * depth
    body = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 3, "guided_json": {schema}}}'
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    r = httpx.post(url, content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.endswith(".") and "\n" not in message
    assert httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                      timeout=60).status_code == 200

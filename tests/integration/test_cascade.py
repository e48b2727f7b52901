"""Two models behind one endpoint and the confidence cascade over them: `kvdeck serve
--model qwen2.5-coder-0.5b --model qwen2.5-coder-1.5b --cascade ...` started as a user
starts it, asked with the official `openai` client."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import serve_process

SMALL, LARGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
SURE = "What is 40 + 21? Reply with the answer only."
"""A question the small model answers with high confidence (0.71 top-1 at its least sure
token, measured on it here)."""
UNSURE = "What is 17 + 74? Reply with the answer only."
"""One it gets wrong with low confidence (0.35)."""


@pytest.fixture(scope="module")
def server(qwen_pair):
    with serve_process("--model", SMALL, "--model", LARGE, "--cascade", f"{SMALL},{LARGE}",
                       "--cascade-threshold", "0.5", start_timeout_s=180) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="none", max_retries=0)


def ask(client: OpenAI, model: str, question: str, **extra):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=16,
        temperature=0, **extra)


def samples(server, name: str) -> dict[tuple, float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_models_lists_both_and_the_cascade(client) -> None:
    assert [m.id for m in client.models.list().data] == [SMALL, LARGE, "cascade"]


def test_requests_go_to_the_model_they_name(server, client) -> None:
    before = samples(server, "vllm:generation_tokens_total")
    reply = ask(client, LARGE, SURE)
    assert reply.model == LARGE
    for _ in range(100):  # the answer can come before the snapshot /metrics reads
        after = samples(server, "vllm:generation_tokens_total")
        grew = {dict(k)["model_name"]: after[k] - before.get(k, 0) for k in after}
        if grew[LARGE] >= reply.usage.completion_tokens:
            break
        time.sleep(0.05)
    assert grew[LARGE] == reply.usage.completion_tokens and grew[SMALL] == 0


def test_the_cascade_keeps_a_sure_answer_and_escalates_an_unsure_one(client) -> None:
    for question, route, model in ((SURE, "small", SMALL),
                                   (UNSURE, "escalated-confidence", LARGE)):
        reply = ask(client, "cascade", question)
        routed = reply.model_extra["kvdeck_cascade"]
        assert reply.model == "cascade"
        assert routed["route"] == route and routed["answered_by"] == model
        assert (routed["confidence"] >= 0.5) == (route == "small")
        # The answer is the one that model gives when asked by name (greedy).
        alone = ask(client, model, question)
        assert reply.choices[0].message.content == alone.choices[0].message.content


def test_an_answer_failing_its_check_is_escalated(client) -> None:
    reply = ask(client, "cascade", SURE, extra_body={"check": {"expected": "sixty-one"}})
    assert reply.model_extra["kvdeck_cascade"]["route"] == "escalated-check"
    assert reply.model_extra["kvdeck_cascade"]["answered_by"] == LARGE


def test_metrics_count_routes_and_the_shared_device(server, client) -> None:
    before = samples(server, "kvdeck:cascade_requests_total")
    ask(client, "cascade", SURE)
    after = samples(server, "kvdeck:cascade_requests_total")
    routes = {dict(k)["route"]: v - before.get(k, 0) for k, v in after.items()}
    assert routes == {"small": 1, "escalated-confidence": 0, "escalated-check": 0}
    assert sum(samples(server, "kvdeck:device_busy_seconds_total").values()) > 0
    assert {dict(k)["model_name"] for k in samples(server, "kvdeck:busy_seconds_total")} \
        == {SMALL, LARGE}


def test_a_streamed_cascade_answer_comes_once_decided(client) -> None:
    whole = ask(client, "cascade", UNSURE)
    chunks = list(ask(client, "cascade", UNSURE, stream=True,
                      stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].model_extra["kvdeck_cascade"]["route"] == "escalated-confidence"
    assert chunks[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_samples_are_refused_by_the_cascade(client) -> None:
    with pytest.raises(BadRequestError, match="answers one sample"):
        ask(client, "cascade", SURE, n=2)


def test_an_unknown_model_is_named_with_the_served_ones(client) -> None:
    with pytest.raises(NotFoundError, match=f"The model 'gpt-4' does not exist; this server "
                                            f"serves '{SMALL}', '{LARGE}', 'cascade'."):
        ask(client, "gpt-4", SURE)


def test_bench_reports_cost_per_good_answer_for_each_model(server) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvdeck.console.cli", "bench", "--questions",
         "checked-questions", "--limit", "6", "--models", f"{SMALL},{LARGE},cascade",
         "--url", server.url, "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    arms = {a["model"]: a for a in json.loads(run.stdout)["arms"]}
    assert list(arms) == [SMALL, LARGE, "cascade"]
    for arm in arms.values():
        assert arm["questions"] == 6 and arm["errors"] == 0 and arm["accelerator_s"] > 0
        good = arm["good"]
        assert arm["accelerator_s_per_good_answer"] == \
            (pytest.approx(arm["accelerator_s"] / good) if good else None)
    assert arms[SMALL]["escalation_rate"] is None
    assert 0 <= arms["cascade"]["escalation_rate"] <= 1


@pytest.mark.parametrize(("args", "says"), [
    (("--model", "gemma3-270m", "--model", SMALL, "--cascade", f"gemma3-270m,{SMALL}"),
     f"The cascade's models gemma3-270m and {SMALL} read text with different tokenizers"),
    (("--model", SMALL, "--model", LARGE, "--cascade", f"{SMALL},{LARGE}",
      "--cascade-threshold", "1.5"),
     "--cascade-threshold must be a probability from 0 to 1, got 1.5."),
    (("--model", SMALL, "--model", SMALL), "--model names the same model twice"),
    (("--model", SMALL, "--model", LARGE, "--served-model-name", "x"),
     "--served-model-name names one model"),
    (("--executor", "sim", "--model", SMALL, "--model", LARGE),
     "Two of the models would be served as"),
])
def test_what_cannot_be_served_gets_one_sentence(qwen_pair, args, says) -> None:
    run = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "serve", "--port", "0",
                          *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert says in " ".join(run.stderr.split())
    assert "Traceback" not in run.stderr


async def test_attach_shows_the_cascades_routing_panel(server, client) -> None:
    """`kvdeck attach` on a cascade server: the routing panel the server's own console has,
    read from /metrics."""
    from kvdeck.console.screens.attach import AttachApp
    from kvdeck.console.widgets.routing import RoutingPanel
    from tests.ui.panel_text import panel_text

    ask(client, "cascade", SURE)
    app = AttachApp(server.url.removesuffix("/v1"), interval_s=0.2)
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(100):
            await pilot.pause(0.1)
            if app.query(RoutingPanel) and app.status and app.status.cascade:
                break
        view = app.status.cascade
        text = " ".join(panel_text(app.query_one(RoutingPanel)).split())
    assert view.config.small == SMALL and view.config.large == LARGE
    assert f"{view.requests:,} requests · escalated {view.escalation_rate:.0%}" in text
    assert "escalate when min-prob < 0.5" in text and view.routes["small"].requests >= 1

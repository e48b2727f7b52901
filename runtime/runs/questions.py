"""Questions with known answers, asked of several models to compare what a good answer
costs on each (`kvdeck bench --questions --models A,B,cascade`).

A question file is JSONL, one `{"question": "...", "check": {...}}` per line, the check in
the API's shape (`runtime/text/checks.py`). Each question is sent as one chat message,
greedy, and its answer judged here by its check. What each arm cost is read from the
server's `/metrics` before and after it: the seconds the device the models share was busy
(`kvdeck:device_busy_seconds`: a second in which both models stepped counts once, so a
cascade pays for both of its models without counting their overlap twice), and the
cascade's routes. Arms run one after another, so each one's seconds are its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvdeck.runtime.errors import KvdeckError, TraceError
from kvdeck.runtime.resources import QUESTIONS
from kvdeck.runtime.runs.endpoints import bearer, server_root
from kvdeck.runtime.text.checks import AnswerCheck, parse_check

DEFAULT_QUESTIONS = "checked-questions"
"""The shipped set's name."""


@dataclass(frozen=True)
class Question:
    text: str
    check: AnswerCheck


def load_questions(source: str = DEFAULT_QUESTIONS) -> list[Question]:
    """The questions of a JSONL file, or the shipped set by its name; TraceError naming the
    line for a malformed one."""
    if source == DEFAULT_QUESTIONS:
        text, where = QUESTIONS.read_text(encoding="utf-8"), "the shipped question set"
    else:
        path = Path(source)
        if not path.is_file():
            raise TraceError(f"There is no question file {source!r}; give a JSONL file of "
                             f"{{\"question\", \"check\"}} lines, or {DEFAULT_QUESTIONS!r}.")
        text, where = path.read_text(encoding="utf-8"), source
    questions = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            o = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}, line {n}: not JSON ({e.msg}).") from None
        if not isinstance(o, dict) or not isinstance(o.get("question"), str) \
                or "check" not in o:
            raise TraceError(f"{where}, line {n}: each line needs a \"question\" string and a "
                             "\"check\".")
        questions.append(Question(o["question"], parse_check(
            o["check"], where=f"The check on {where}, line {n},", error=TraceError)))
    if not questions:
        raise TraceError(f"{where} holds no questions.")
    return questions


@dataclass
class Arm:
    """One model name's answers to the questions, and what they cost."""

    model: str
    answers: list[dict] = field(default_factory=list)
    accelerator_s: float = 0.0
    wall_s: float = 0.0
    routes: dict[str, float] = field(default_factory=dict)

    @property
    def good(self) -> int:
        return sum(a["correct"] for a in self.answers)

    def summary(self) -> dict:
        n = len(self.answers)
        escalated = sum(v for k, v in self.routes.items() if k != "small")
        return {
            "model": self.model, "questions": n, "good": self.good,
            "accuracy": self.good / n if n else 0.0,
            "errors": sum(a["error"] is not None for a in self.answers),
            "accelerator_s": self.accelerator_s,
            "accelerator_s_per_good_answer": self.accelerator_s / self.good if self.good
            else None,
            "mean_latency_s": sum(a["latency_s"] for a in self.answers) / n if n else 0.0,
            "wall_s": self.wall_s,
            "escalated": escalated if self.routes else None,
            "escalation_rate": escalated / n if self.routes and n else None,
        }


def read_costs(text: str) -> tuple[float, dict[str, float]]:
    """From `/metrics` text: the device's busy seconds (`kvdeck:device_busy_seconds`, each
    second once however many models stepped in it; else every model's busy seconds summed),
    and the cascade's requests by route (empty without a cascade)."""
    busy, device, routes = 0.0, None, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvdeck:device_busy_seconds_total":
                device = s.value
            elif s.name == "kvdeck:busy_seconds_total":
                busy += s.value
            elif s.name == "kvdeck:cascade_requests_total":
                routes[s.labels["route"]] = routes.get(s.labels["route"], 0) + s.value
    return (busy if device is None else device), routes


async def ask_all(url: str, model: str, questions: list[Question], *, concurrency: int = 4,
                  max_tokens: int = 16, api_key: str | None = None,
                  timeout_s: float = 600.0) -> Arm:
    """Every question asked of `model` at `url` (an OpenAI base URL), at most `concurrency`
    at a time."""
    base, root, headers = url.rstrip("/"), server_root(url), bearer(api_key)
    arm = Arm(model)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        async def costs() -> tuple[float, dict[str, float]]:
            try:
                r = await client.get(f"{root}/metrics")
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise KvdeckError(f"Could not read {root}/metrics ({type(e).__name__}: {e}); "
                                  "bench --questions reads each arm's accelerator time from "
                                  "a kvdeck server's /metrics.") from None
            return read_costs(r.text)

        def failed(q: Question, latency: float, message: str) -> dict:
            return {"question": q.text, "answer": None, "correct": False,
                    "latency_s": latency, "error": message, "route": None}

        async def ask(q: Question) -> dict:
            async with gate:
                start = time.monotonic()
                try:
                    r = await client.post(f"{base}/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": q.text}],
                        "max_tokens": max_tokens, "temperature": 0})
                except httpx.HTTPError as e:
                    return failed(q, time.monotonic() - start, f"{type(e).__name__}: {e}")
                latency = time.monotonic() - start
            if r.status_code != 200:
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = f"HTTP {r.status_code}: {r.text[:200]}"
                return failed(q, latency, message)
            body = r.json()
            text = body["choices"][0]["message"]["content"] or ""
            return {"question": q.text, "answer": text, "correct": q.check.passes(text),
                    "latency_s": latency, "error": None,
                    "route": (body.get("kvdeck_cascade") or {}).get("route")}

        busy0, routes0 = await costs()
        start = time.monotonic()
        arm.answers = list(await asyncio.gather(*(ask(q) for q in questions)))
        arm.wall_s = time.monotonic() - start
        busy1, routes1 = await costs()
        for _ in range(20):  # the last steps reach /metrics with the loop's next snapshot
            await asyncio.sleep(0.1)
            later = await costs()
            if later == (busy1, routes1):
                break
            busy1, routes1 = later
    arm.accelerator_s = busy1 - busy0
    # Only the cascade's own arm moves its route counters.
    arm.routes = {k: v - routes0.get(k, 0) for k, v in routes1.items()
                  if v - routes0.get(k, 0)}
    return arm


def compare(arms: list[Arm]) -> dict:
    """The arms side by side, each one's cost per good answer against the others'."""
    rows = [a.summary() for a in arms]
    for row in rows:
        mine = row["accelerator_s_per_good_answer"]
        row["cost_per_good_vs"] = {
            other["model"]: mine / other["accelerator_s_per_good_answer"]
            for other in rows if other is not row and mine is not None
            and other["accelerator_s_per_good_answer"]}
    return {"arms": rows, "answers": {a.model: a.answers for a in arms}}

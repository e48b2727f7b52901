"""`kvdeck bench --questions Q --models A,B,cascade`: what a good answer costs on each model
(`runtime/runs/questions.py`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rich.table import Table

from kvdeck.console.commands.common import err, fail, guarded, out, print_json
from kvdeck.runtime.core.config import check_int


def bench_models(opts) -> None:
    """Each model of `opts.models` answers every question of `opts.questions`, one model
    after another; a table (or JSON) of accuracy, escalations and cost per good answer."""
    from kvdeck.runtime.runs.questions import DEFAULT_QUESTIONS, ask_all, compare, load_questions

    if not opts.models:
        fail("--questions compares models: give them with --models A,B[,cascade].")
    models = [m.strip() for m in opts.models.split(",")]
    if not all(models) or len(set(models)) < len(models):
        fail(f"--models takes distinct model names, comma-separated; got {opts.models!r}.")
    concurrency = opts.concurrency or 4
    guarded(lambda: check_int("--concurrency", concurrency, 1, 1 << 16))
    questions = guarded(lambda: load_questions(opts.questions or DEFAULT_QUESTIONS))
    if opts.limit is not None:
        guarded(lambda: check_int("--limit", opts.limit, 1, 1 << 30))
        questions = questions[:opts.limit]

    async def run_all():
        arms = []
        for model in models:
            err.print(f"{len(questions)} questions → {model} at {opts.url}", highlight=False)
            arms.append(await ask_all(opts.url, model, questions, concurrency=concurrency,
                                      api_key=opts.api_key))
        return arms

    result = compare(guarded(lambda: asyncio.run(run_all())))
    if opts.output:
        Path(opts.output).write_text(json.dumps(result, indent=1))
    if opts.as_json:
        print_json(result)
        return
    out.print(table(result["arms"], len(questions)))
    for model, answers in result["answers"].items():
        failed = [a["error"] for a in answers if a["error"] is not None]
        if failed:
            err.print(f"{model}: {len(failed)} of {len(answers)} questions got an error "
                      f"instead of an answer, the first: {failed[0]}", highlight=False)


def table(rows: list[dict], n: int) -> Table:
    """One row per model: accuracy, escalations, accelerator seconds per good answer and
    that cost against the other models'."""
    t = Table(title=f"kvdeck bench: {n} checked questions, greedy, one model after another")
    for name in ("model", "good", "accuracy", "escalated", "accel. s", "s / good answer",
                 "mean latency", "vs others"):
        t.add_column(name, justify="left" if name in ("model", "vs others") else "right")
    for r in rows:
        per_good = r["accelerator_s_per_good_answer"]
        escalated = "—" if r["escalated"] is None else \
            f"{r['escalated']:.0f} ({r['escalation_rate']:.0%})"
        vs = ", ".join(f"{x:.2f}× {m}" for m, x in r["cost_per_good_vs"].items())
        t.add_row(r["model"], f"{r['good']}/{r['questions']}", f"{r['accuracy']:.1%}",
                  escalated, f"{r['accelerator_s']:.2f}",
                  "—" if per_good is None else f"{per_good:.3f}",
                  f"{r['mean_latency_s']:.2f} s", vs or "—")
    return t

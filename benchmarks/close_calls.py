"""How near a predicted run came to a coin toss: the least time between a request's coming
in and the start of a step that it just made or just missed, where that decided more than
when its own prompt ran.

A server takes in, for its next step, whatever has come in by then. Where a request comes
in a millisecond before a step starts, it runs its prompt in that step; a millisecond
later, in the steps after it: beside other prompt pieces or not, and before or after
another request's last token, which its prompt stalls or not. A server's own timing moves
by more than a millisecond from run to run, so a trace with an arrival that close to a
step's start measures a coin toss there, not the step model.

Measured on llama-server (Gemma 3 270M, 2 cores): the Mooncake excerpt's second request,
sent 20 ms after the first, came in 0.2 ms before the sim's first step (the first's
arrival, then its wait for the saves of idle slots: `executors/server_slots.py`); in
three runs its first token came 1.4–1.7 s after the first's, as where it misses that
step, and the sim, which put it in, predicted a TPOT median of 1.38 times the measured
one; with the request 10 ms later the same fit predicts 1.07.

`close_call_s` reads a run's record (`kvdeck run-trace --record`, read as replay reads
it), which gives each step's start and the requests it admitted, and each request's
arrival.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.runs.recording import read_run


def close_call_s(record: Path, intake_s: float) -> float:
    """The least time, over the steps of the run recorded at `record` (a run directory),
    between a step's start and the coming in of a request (its arrival plus `intake_s`,
    the sim's way in from outside) that it admitted, or that the next step admitted having
    come in after this one started, where that changed more than when the request's own
    prompt ran (`swayed`); infinite where there is none."""
    steps = [r for r in read_run(record)[1] if isinstance(r, StepRecord)]
    came = {a.request_id: a.arrival_time + intake_s for s in steps for a in s.arrived}
    prompt = {a.request_id: a.num_prompt_tokens for s in steps for a in s.arrived}
    least = math.inf
    for i, s in enumerate(steps):
        # Prompt work starts before the prompt's end (a step that ran nothing has no plan).
        work = {p.request_id for p in s.plan if p.start < prompt.get(p.request_id, 0)}
        ended = {f.request_id for f in s.finished}
        # Requests the record never saw arrive (a fork's child) have no time to compare.
        for rid in s.admitted:
            if rid in came and swayed(rid, work, ended):
                least = min(least, s.t0 - came[rid])
        for rid in steps[i + 1].admitted if i + 1 < len(steps) else ():
            if rid in came and came[rid] >= s.t0 and swayed(rid, work, ended):
                least = min(least, came[rid] - s.t0)
    return least


def swayed(rid: str, work: set[str], ended: set[str]) -> bool:
    """Whether a step whose prompt work is of `work` and in which `ended` finished would
    have run otherwise with `rid` in it or out of it: others' prompt pieces beside its
    prompt (or in its place), or another request's last token, which its prompt stalls or
    not. (The request that started a step on an idle engine is never swayed alone: whoever
    sways it came in later, nearer the step's start.)"""
    return bool(work - {rid} or ended - {rid})

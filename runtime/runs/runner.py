"""Run an arrival trace through an engine and summarize the outcome.

Arrivals are handed to the engine as they come due (`AHEAD_S` early where it holds its loop
before taking them in; tokens are synthesized then, not up front), so memory stays
proportional to the requests in flight even for the 12,031-request Mooncake trace. A
request the engine refuses (prompt longer than the context, say) is recorded as rejected
with the reason — never silently dropped. Arrivals that carry an answer check need an
engine with a tokenizer (`needs_tokenizer`); their answers end where the model ends them
(end-of-sequence is honoured), up to the traced output length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.errors import ConfigError, KvdeckError
from kvdeck.runtime.executors.base import LaunchHold, Modelled, has
from kvdeck.runtime.runs.trace import Arrival, synthesize_tokens
from kvdeck.runtime.stats.energy import EnergyMeter, energy_figures, modelled_energy
from kvdeck.runtime.stats.figures import RunFigures, kv_summary, summarize
from kvdeck.runtime.stats.metrics import SLO, RequestMetrics, request_metrics

AHEAD_S = 1.0
"""How early an arrival is handed to an engine whose executor holds its loop before taking
requests in (`LaunchHold`: llama-server saving its idle slots), which takes in those that
arrive meanwhile: they must be in its hands by then (the engine holds each until it is
due). A second is some fifty saves of a Gemma 3 slot here. Other engines get each when it
is due, so that one waiting to come due never fills their queue's bound."""


def rejected(a: Arrival, rid: str, reason: str) -> RequestMetrics:
    """The metrics of an arrival refused before an engine took it."""
    return RequestMetrics(rid, RequestStatus.REJECTED.value, reason, a.arrival_s, None, None,
                          a.arrival_s, a.prompt_len, 0, 0, 0, None, None, None, None, (),
                          None, None)


def needs_tokenizer(arrivals: Sequence[Arrival]) -> bool:
    """Whether any arrival carries an answer check (checks read the answer's text)."""
    return any(a.check is not None for a in arrivals)


def run_arrivals(engine: Engine, arrivals: Sequence[Arrival], *, vocab_size: int,
                 hash_block_tokens: int = 512, slo: SLO = SLO(),
                 on_step: Callable[[Engine], None] | None = None,
                 on_arrival: Callable[[Arrival], None] | None = None,
                 before: Sequence[Arrival] = ()) -> dict:
    """Feed `arrivals` at their times, step until all are done, and return
    `{"summary": ..., "requests": [...]}` (requests as RequestMetrics dicts, arrival order).

    `before`: requests served first, one after another and not counted (`run_before`);
    the trace's times then count from when the last of them ended."""
    metrics: list[RequestMetrics] = []
    # A sim fitted from outside a server takes each request in this long after it was sent
    # (its way through HTTP); its TTFT still counts from the sending.
    intake_s = getattr(engine.executor, "request_overhead_s", 0.0)
    offset = run_before(engine, before, vocab_size, hash_block_tokens, intake_s,
                        len(arrivals))
    # Real executors: the machine's energy counters over the run; the sim models it.
    meter = None if engine.executor.info.virtual_time else EnergyMeter.probe()
    # The engine's times count from its start, the trace's from after `before`.
    engine.on_finish.append(lambda req: metrics.append(shifted(request_metrics(req), -offset)))
    ex = engine.executor
    ahead = AHEAD_S if has(ex, LaunchHold) and ex.holds else 0.0
    i = 0
    while True:
        now = engine.clock.now() - offset
        if i < len(arrivals) and not engine.has_work:
            # Idle: the clock jumps to the next arrival, and everyone due by then comes in
            # with it (requests that arrive together are planned together).
            now = max(now, arrivals[i].arrival_s)
        while i < len(arrivals) and arrivals[i].arrival_s <= now + ahead:
            a = arrivals[i]
            rid = a.request_id or f"r{i}"
            if on_arrival is not None:
                on_arrival(a)
            try:
                tokens = synthesize_tokens(a, i, vocab_size, hash_block_tokens)
                # Traces fix output lengths: generate exactly that many tokens, unless the
                # answer is checked: then it ends where the model ends it.
                sampling = SamplingParams(max_tokens=a.output_len,
                                          ignore_eos=a.check is None)
                engine.add_request(tokens, sampling, request_id=rid,
                                   arrival_time=a.arrival_s + offset,
                                   deadline_s=a.deadline_s,
                                   priority=a.priority, check=a.check, intake_s=intake_s)
            except KvdeckError as e:
                metrics.append(rejected(a, rid, str(e)))
            i += 1
        if not engine.has_work:
            break
        step(engine)
        if on_step is not None:
            on_step(engine)
    order = {(a.request_id or f"r{j}"): j for j, a in enumerate(arrivals)}
    metrics.sort(key=lambda m: order.get(m.request_id, len(order)))
    summary = summarize(metrics, engine.figures, slo)
    summary.update(run_summary_extras(engine))
    summary["energy"] = energy_summary(engine, meter, summary["num_good"])
    return {"summary": summary, "requests": [m.to_dict() for m in metrics]}


def step(engine: Engine) -> None:
    """One engine step; on the wall clock, a short wait where nothing was due yet."""
    if engine.step() is None and not engine.executor.info.virtual_time:
        time.sleep(0.001)  # wall clock: wait for the next arrival to come due


def run_before(engine: Engine, before: Sequence[Arrival], vocab_size: int,
               hash_block_tokens: int, intake_s: float, first_index: int) -> float:
    """Serve `before` one after another, each sent when the last has ended (as `kvdeck
    bench` sends its warm-up, and a harness its start-up check, before a trace), and
    return when the last ended: the engine then holds what they left (llama-server's
    slots taken and their prompts kept, cached prefixes), as the measured server did. Their
    arrival times are ignored; the engine's figures start again after them (the prefix
    tree's counts keep them). Prompts they do not carry are drawn as those of requests
    `first_index` on (past the trace's, whose prompts they must not repeat)."""
    if not before:
        return 0.0
    for j, a in enumerate(before):
        tokens = synthesize_tokens(a, first_index + j, vocab_size, hash_block_tokens)
        try:
            engine.add_request(tokens, SamplingParams(max_tokens=a.output_len,
                                                      ignore_eos=True),
                               request_id=f"before-{j}", arrival_time=engine.clock.now(),
                               intake_s=intake_s)
        except KvdeckError as e:
            raise ConfigError(f"--before's request {j + 1} was refused: "
                              f"{str(e).rstrip('.')}.") from None
        while engine.has_work:
            step(engine)
    engine.figures = RunFigures()
    return engine.clock.now()


def shifted(m: RequestMetrics, dt: float) -> RequestMetrics:
    """`m` with its times moved by `dt` seconds (its durations unchanged)."""
    if not dt:
        return m
    def move(t: float | None) -> float | None:
        return None if t is None else t + dt
    return replace(m, arrival=m.arrival + dt, admitted=move(m.admitted),
                   first_token=move(m.first_token), finish=move(m.finish),
                   deadline=move(m.deadline), predicted_finish=move(m.predicted_finish))


def energy_summary(engine: Engine, meter: EnergyMeter | None, num_good: int) -> dict:
    """Joules over the run and per good result: read from the machine's counters
    (`meter`), or, on the sim, modelled as its busy time at the card profile's power limit
    (an upper bound, as the planner prices it); `source` says which, or why there is none."""
    if meter is not None:
        return energy_figures(meter.joules(), meter.source, num_good)
    ex = engine.executor
    card, watts = (ex.hardware.name, ex.hardware.power_watts) if has(ex, Modelled) else ("", 0.0)
    return modelled_energy(engine.figures.busy_seconds, card, watts, num_good)


def run_summary_extras(engine: Engine) -> dict:
    """KV figures the run summary reports besides request metrics."""
    kv = engine.kv
    return kv_summary(engine.executor.info.name, engine.executor.info.model_name, kv.num_blocks,
                      kv.block_size, kv.bytes_per_block, kv.tree, kv.num_cow_copies)

"""The running figures a live engine shows — counts, rolling latency percentiles, latency
histograms, goodput, Little's law, and a time-bucketed history for charts.

`RunFigures` is fed by two callers with the same data: the engine after every step and every
finished request, and replay from the iteration trace (the step record and the rebuilt
request state carry the same numbers). So the console shows the same figures live and in
replay, computed by this one piece of code, and `/metrics` exports them from the snapshot.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvdeck.runtime.stats.metrics import SLO, Distribution, RequestMetrics, good
from kvdeck.runtime.stats.waste import Waste, WasteView

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the latency histograms, as vLLM's exporter uses."""


class Histogram:
    """Cumulative bucket counts, sum and count of one latency (Prometheus semantics)."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        """Per bucket (not cumulative); the last is +Inf."""
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def view(self) -> HistogramView:
        return HistogramView(self.bounds, tuple(self.counts), self.sum, self.count)

    def to_json(self) -> dict:
        return {"counts": self.counts, "sum": self.sum, "count": self.count}

    def load(self, d: dict) -> None:
        self.counts, self.sum, self.count = list(d["counts"]), d["sum"], d["count"]


@dataclass(frozen=True)
class HistogramView:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations ≤ bound) pairs, +Inf last, as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass(frozen=True)
class Bucket:
    """What happened in one history interval of engine time."""

    start: float
    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    """Tokens sampled (decodes, and each prefill's first token)."""
    finished: int = 0
    arrivals: int = 0
    kv_usage: float = 0.0
    """Last value in the interval (blocks held by requests / pool)."""
    kv_cached: float = 0.0
    """Blocks only the prefix cache holds / pool, last value."""
    hit_rate: float = 0.0
    running: int = 0
    waiting: int = 0
    knob_change: bool = False
    bytes_read: float = 0.0
    """Weight and KV bytes its steps read (the executors' own `bytes_read`)."""

    def with_step(self, s: StepFigures) -> Bucket:
        return Bucket(self.start, self.steps + 1, self.busy_s + s.dt,
                      self.prefill_tokens + s.prefill_tokens,
                      self.decode_tokens + s.decode_tokens,
                      self.generated_tokens + s.sampled_tokens, self.finished + s.finished,
                      self.arrivals + s.arrivals, s.kv_usage, s.kv_cached, s.hit_rate,
                      s.running, s.waiting, self.knob_change or s.knob_change,
                      self.bytes_read + s.bytes_read)


@dataclass(frozen=True)
class StepFigures:
    """One step's figures, as the step record and the KV state after it give them."""

    t1: float
    dt: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    sampled_tokens: int
    """Tokens generated: every decode's, plus each prefill's last chunk's first token."""
    finished: int
    arrivals: int
    resident: int
    kv_usage: float
    kv_cached: float
    hit_rate: float
    running: int
    waiting: int
    knob_change: bool
    predicted: float | None = None
    """The timing model's prediction of `dt`, made when the step was planned."""
    bytes_read: int = 0


def step_figures(record, kv_usage: float, kv_cached: float, hit_rate: float) -> StepFigures:
    """One executed step's figures from its record (a `step_record.StepRecord`) and the KV
    state after it — the same for the live engine and for replay."""
    return StepFigures(record.t1, record.dt or 0.0, len(record.plan), record.num_prefill,
                       record.num_decode, len(record.tokens),
                       len(record.finished), len(record.arrived), record.resident, kv_usage,
                       kv_cached, hit_rate, record.queue[1], record.queue[0],
                       bool(record.knobs), record.predicted_s, record.bytes_read)


class RunFigures:
    """Counts, rolling latency, histograms and history for one engine (or its replay)."""

    def __init__(self, window: int = 256, itl_window: int = 4096, bucket_s: float = 1.0,
                 history: int = 3600):
        self.window = window
        self.bucket_s = bucket_s
        self.status_counts: dict[str, int] = {}
        self.recent: deque[RequestMetrics] = deque(maxlen=window)
        """The most recently finished requests."""
        self.recent_itls: deque[float] = deque(maxlen=itl_window)
        self.histograms = {name: Histogram() for name in ("ttft", "itl", "e2e", "queue")}
        self.num_good = 0
        """Finished requests that met their deadline (or had none) and passed their answer
        check (or carried none)."""
        self.num_with_deadline = 0
        self.num_checked = 0
        """Finished answers that carried a check (`runtime/text/checks.py`)."""
        self.num_check_failures = 0
        """Of those, the answers that failed it."""
        self.prompt_tokens = 0
        """Prompt tokens computed (prefill, including recomputation)."""
        self.generation_tokens = 0
        """Tokens generated (vLLM's generation_tokens)."""
        self.decode_tokens = 0
        self.resident_seconds = 0.0
        """∫ (waiting + running requests) dt, for the Little's-law check."""
        self.busy_seconds = 0.0
        """Sum of step times: accelerator-busy time."""
        self.num_steps = 0
        # Running sums, not per-step lists: a server steps for days.
        self.sum_batch_size = 0
        self.sum_batch_tokens = 0
        self.first_time: float | None = None
        self.last_time = 0.0
        self.buckets: deque[Bucket] = deque(maxlen=history)
        self.num_finished_seen = 0
        self._rolling: tuple[int, dict] | None = None
        self.recent_steps: deque[tuple[float, float]] = deque()
        """(predicted, measured) seconds of the latest `window` steps that took time: how
        honest the timing model that admission, the ITL target and speculation rely on is."""
        self.waste = Waste()
        """Computed against useful tokens, by cause (`stats/waste.py`)."""
        self._step_sums = [0.0, 0.0, 0.0]
        """Σ predicted, Σ measured, Σ |predicted − measured| / measured over them (kept as
        steps come and go, so a snapshot does not walk the window)."""

    @classmethod
    def combined(cls, many: list[RunFigures]) -> RunFigures:
        """The run figures `summarize` reads, summed over engines (a fleet's replicas)."""
        out = cls()
        for f in many:
            for name in ("num_steps", "busy_seconds", "resident_seconds", "prompt_tokens",
                         "decode_tokens", "generation_tokens", "sum_batch_size",
                         "sum_batch_tokens"):
                setattr(out, name, getattr(out, name) + getattr(f, name))
            out.waste.computed += f.waste.computed
            for cause, n in f.waste.wasted.items():
                out.waste.wasted[cause] += n
        return out

    # -- feeding ----------------------------------------------------------------------------

    def on_arrival(self, waited_s: float) -> None:
        """A request entered the queue `waited_s` after its scheduled arrival."""
        self.resident_seconds += waited_s

    def on_finish(self, m: RequestMetrics) -> None:
        self.status_counts[m.status] = self.status_counts.get(m.status, 0) + 1
        self.recent.append(m)
        self.recent_itls.extend(m.itls)
        h = self.histograms
        if m.ttft is not None:
            h["ttft"].observe(m.ttft)
        for x in m.itls:
            h["itl"].observe(x)
        if m.e2e is not None:
            h["e2e"].observe(m.e2e)
            if m.met_deadline is not False and m.correct is not False:
                self.num_good += 1
        if m.deadline is not None:
            self.num_with_deadline += 1
        if m.correct is not None:
            self.num_checked += 1
            self.num_check_failures += not m.correct
        if m.queue_time is not None:
            h["queue"].observe(m.queue_time)
        self.num_finished_seen += 1

    def on_step(self, s: StepFigures, record=None) -> None:
        """One executed step's figures; `record` (its `StepRecord`) feeds the waste count."""
        if record is not None:
            self.waste.on_record(record, s.prefill_tokens + s.decode_tokens)
        self.num_steps += 1
        self.busy_seconds += s.dt
        self.sum_batch_size += s.num_seqs
        self.sum_batch_tokens += s.prefill_tokens + s.decode_tokens
        self.resident_seconds += s.resident * s.dt
        self.prompt_tokens += s.prefill_tokens
        self.decode_tokens += s.decode_tokens
        self.generation_tokens += s.sampled_tokens
        if s.predicted is not None:
            self._observe_step(s.predicted, s.dt)
        if self.first_time is None:
            self.first_time = s.t1 - s.dt
        self.last_time = max(self.last_time, s.t1)
        start = math.floor(s.t1 / self.bucket_s) * self.bucket_s
        if self.buckets and self.buckets[-1].start == start:
            self.buckets[-1] = self.buckets[-1].with_step(s)
        else:
            self.buckets.append(Bucket(start).with_step(s))

    # -- views ------------------------------------------------------------------------------

    def rolling(self) -> dict:
        """Latency distributions over the most recently finished requests, the fraction of
        them that were good (on time, and correct where checked), and the Little's-law check
        over the run up to the end of its last step (not the wall clock now, so live, replay
        and run-trace agree on a run). The distributions are recomputed only when a request
        finished since the last call."""
        if self._rolling is None or self._rolling[0] != self.num_finished_seen:
            recent = list(self.recent)
            done = [m for m in recent if m.status.startswith("finished")]
            good = [m for m in done if m.met_deadline is not False and m.correct is not False]
            residence = [m.finish - m.arrival for m in recent if m.finish is not None]
            self._rolling = (self.num_finished_seen, {
                "forecast_error": forecast_error(recent),
                "ttft": Distribution.of(m.ttft for m in recent if m.ttft is not None),
                "tpot": Distribution.of(m.tpot for m in recent if m.tpot is not None),
                "itl": Distribution.of(self.recent_itls),
                "e2e": Distribution.of(m.e2e for m in recent if m.e2e is not None),
                "good_fraction": len(good) / len(done) if done else None,
                "has_deadlines": any(m.deadline is not None for m in recent),
                "has_checks": any(m.correct is not None for m in recent),
                "mean_residence": math.fsum(residence) / len(residence) if residence else None,
            })
        figures = dict(self._rolling[1])
        span = max(self.last_time - (self.first_time or 0.0), 1e-9)
        figures["mean_resident"] = self.resident_seconds / span
        residence = figures.pop("mean_residence")
        figures["littles_prediction"] = sum(self.status_counts.values()) / span * residence \
            if residence is not None else None
        figures["step_model"] = self.step_model()
        return figures

    def _observe_step(self, predicted: float, measured: float) -> None:
        if measured <= 0:
            return
        sums = self._step_sums
        for i, x in enumerate((predicted, measured, abs(predicted - measured) / measured)):
            sums[i] += x
        self.recent_steps.append((predicted, measured))
        if len(self.recent_steps) > self.window:
            p, m = self.recent_steps.popleft()
            for i, x in enumerate((p, m, abs(p - m) / m)):
                sums[i] -= x

    def step_model(self) -> tuple[float, float, float] | None:
        """(mean predicted, mean measured seconds, mean |predicted − measured| / measured)
        over the latest steps; None before any."""
        n = len(self.recent_steps)
        return tuple(x / n for x in self._step_sums) if n else None

    def view(self) -> FiguresView:
        return FiguresView(
            status_counts=dict(self.status_counts),
            histograms={k: h.view() for k, h in self.histograms.items()},
            num_good=self.num_good, num_checked=self.num_checked,
            num_check_failures=self.num_check_failures, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, busy_seconds=self.busy_seconds,
            num_steps=self.num_steps, history=tuple(self.buckets), bucket_s=self.bucket_s,
            waste=self.waste.view())

    # -- checkpoints ------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "status_counts": self.status_counts,
            "recent": [m.to_dict() for m in self.recent],
            "recent_itls": list(self.recent_itls),
            "histograms": {k: h.to_json() for k, h in self.histograms.items()},
            "num_good": self.num_good, "num_with_deadline": self.num_with_deadline,
            "num_checked": self.num_checked, "num_check_failures": self.num_check_failures,
            "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
            "decode_tokens": self.decode_tokens,
            "resident_seconds": self.resident_seconds, "busy_seconds": self.busy_seconds,
            "num_steps": self.num_steps, "sum_batch_size": self.sum_batch_size,
            "sum_batch_tokens": self.sum_batch_tokens, "first_time": self.first_time,
            "last_time": self.last_time, "buckets": [asdict(b) for b in self.buckets],
            "recent_steps": [list(x) for x in self.recent_steps],
            "waste": self.waste.to_json(),
        }

    def load(self, d: dict) -> None:
        """Continue from a checkpoint's figures."""
        self.status_counts = dict(d["status_counts"])
        self.recent.extend(RequestMetrics(**{**m, "itls": tuple(m["itls"])})
                           for m in d["recent"])
        self.recent_itls.extend(d["recent_itls"])
        for k, h in self.histograms.items():
            h.load(d["histograms"][k])
        for key in ("num_good", "num_with_deadline", "prompt_tokens", "generation_tokens",
                    "decode_tokens",
                    "resident_seconds", "busy_seconds", "num_steps", "sum_batch_size",
                    "sum_batch_tokens", "first_time", "last_time"):
            setattr(self, key, d[key])
        # Runs recorded before answer checks have no check counts.
        self.num_checked = d.get("num_checked", 0)
        self.num_check_failures = d.get("num_check_failures", 0)
        self.buckets.extend(Bucket(**b) for b in d["buckets"])
        for p, m in d.get("recent_steps", ()):
            self._observe_step(p, m)
        if "waste" in d:
            self.waste.load(d["waste"])
        self.num_finished_seen += 1


@dataclass(frozen=True)
class FiguresView:
    """The part of `RunFigures` a snapshot carries (immutable)."""

    status_counts: dict[str, int]
    histograms: dict[str, HistogramView]
    num_good: int
    num_checked: int
    num_check_failures: int
    prompt_tokens: int
    generation_tokens: int
    busy_seconds: float
    num_steps: int
    history: tuple[Bucket, ...]
    bucket_s: float
    waste: WasteView | None = None


def forecast_error(ms: Sequence[RequestMetrics]) -> tuple[float, int] | None:
    """(mean |finish − predicted finish| / (finish − arrival), requests) over the finished
    requests admission control forecast; None when there are none."""
    errors = [abs(m.finish - m.predicted_finish) / max(m.finish - m.arrival, 1e-9)
              for m in ms if m.predicted_finish is not None and m.finish is not None
              and m.status.startswith("finished")]
    return (math.fsum(errors) / len(errors), len(errors)) if errors else None


def summarize(ms: Sequence[RequestMetrics], stats: RunFigures | None = None,
              slo: SLO = SLO()) -> dict:
    """A run's figures as plain data: counts, latency distributions, throughput, goodput,
    answer checks, Little's law, per-step figures and accelerator-seconds per good result.
    `stats`: the engine's running figures (None for a remote server, whose steps are not
    seen). Good requests met the SLOs and passed their check if they carried one."""
    stats = stats or RunFigures()
    start = min((m.arrival for m in ms), default=0.0)
    end = max((m.finish for m in ms if m.finish is not None), default=start)
    span = max(end - start, 1e-12)
    finished = [m for m in ms if m.status in ("finished_stopped", "finished_length")]
    good_ones = [m for m in finished if good(m, slo)]
    checked = [m for m in ms if m.correct is not None]
    residence = [m.finish - m.arrival for m in ms if m.finish is not None]
    arrival_rate = len(residence) / span
    steps = stats.num_steps
    statuses: dict[str, int] = {}
    for m in ms:
        statuses[m.status] = statuses.get(m.status, 0) + 1
    return {
        "num_requests": len(ms),
        "statuses": statuses,
        "makespan_s": span if ms else 0.0,
        "completion_throughput_rps": len(finished) / span,
        "goodput_rps": len(good_ones) / span,
        "num_good": len(good_ones),
        "num_checked": len(checked),
        "num_correct": sum(1 for m in checked if m.correct),
        "output_tokens_per_s": sum(m.output_tokens for m in finished) / span,
        "prompt_tokens": sum(m.prompt_tokens for m in ms),
        "cached_prompt_tokens": sum(m.cached_tokens for m in ms),
        "num_preemptions": sum(m.num_preemptions for m in ms),
        "ttft_s": asdict(Distribution.of(m.ttft for m in ms if m.ttft is not None)),
        "tpot_s": asdict(Distribution.of(m.tpot for m in ms if m.tpot is not None)),
        "itl_s": asdict(Distribution.of(x for m in ms for x in m.itls)),
        "e2e_s": asdict(Distribution.of(m.e2e for m in ms if m.e2e is not None)),
        "queue_s": asdict(Distribution.of(m.queue_time for m in ms
                                          if m.queue_time is not None)),
        "littles_law": {
            "measured_mean_resident": stats.resident_seconds / span,
            "arrival_rate_rps": arrival_rate,
            "mean_residence_s": math.fsum(residence) / len(residence) if residence else 0.0,
            "predicted_mean_resident": arrival_rate * (math.fsum(residence) / len(residence))
            if residence else 0.0,
        },
        "steps": {
            "count": steps,
            "busy_s": stats.busy_seconds,
            "mean_batch_size": stats.sum_batch_size / steps if steps else 0.0,
            "mean_batch_tokens": stats.sum_batch_tokens / steps if steps else 0.0,
            "mean_step_s": stats.busy_seconds / steps if steps else 0.0,
            "prefill_tokens": stats.prompt_tokens,
            "decode_tokens": stats.decode_tokens,
            "generated_tokens": stats.generation_tokens,
            "computed_tokens": stats.waste.computed,
            "wasted_tokens": dict(stats.waste.wasted),
        },
        "accelerator_s_per_good_result": stats.busy_seconds / len(good_ones) if good_ones
        else None,
        "finish_forecast_error": (forecast_error(ms) or (None,))[0],
        "slo": asdict(slo),
    }


def kv_summary(executor: str, model: str, num_blocks: int, block_size: int,
               bytes_per_block: int, tree, num_cow_copies: int) -> dict:
    """The KV figures a run summary reports besides request metrics (live and replayed)."""
    return {
        "executor": executor,
        "model": model,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "kv_bytes_per_block": bytes_per_block,
        "prefix_hit_rate": tree.hit_rate,
        "prefix_hit_tokens": tree.num_hit_tokens,
        "prefix_query_tokens": tree.num_query_tokens,
        "num_evictions": tree.num_evictions,
        "num_cow_copies": num_cow_copies,
        "prefix_demotions": tree.num_demotions,
        "prefix_host_hit_tokens": tree.num_host_hit_tokens,
        "prefix_device_hit_tokens": tree.num_hit_tokens - tree.num_host_hit_tokens,
    }

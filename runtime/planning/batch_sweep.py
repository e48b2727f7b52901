"""The sweeps the source chapter runs beside the arrival-rate sweep (`sweep.py`): the batch
size (Experiment 8-1: `b` requests arriving together — throughput, time to first token, the
gap between outputs, and what one full decode step reads and how much of the memory
bandwidth that is) and the admission mode (Experiment 8-9: goodput per mode and arrival
rate with one request at a time, continuous batching, or a whole batch admitted at once and
run to its end)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.planning.sweep import SweepPoint, sweep
from kvdeck.runtime.runs.trace import Arrival

ADMISSION_MODES: dict[str, dict] = {
    "one-at-a-time": {"max_num_seqs": 1, "scheduling": "continuous"},
    "continuous": {"scheduling": "continuous"},
    "all-at-once": {"scheduling": "static"},
}
"""Each admission mode as the engine knobs that make it."""


def batch_arrivals(batch: int, prompt_len: int, output_len: int) -> list[Arrival]:
    """`batch` requests of `prompt_len` tokens and `output_len` outputs, all at time 0."""
    return [Arrival(0.0, prompt_len, output_len) for _ in range(batch)]


@dataclass(frozen=True)
class BatchPoint:
    """One batch size's run."""

    batch: int
    throughput_tps: float
    """Output tokens over the time until the last request finished."""
    ttft_mean_s: float
    itl_mean_s: float
    decode_step_s: float | None
    """Median step in which every request of the batch decoded one token (None when no
    step had them all)."""
    bytes_per_step: float | None
    """Median bytes such a step read, as the executor reports them."""
    mbu: float | None
    """`bytes / step / bandwidth` (None without a bandwidth)."""

    @classmethod
    def of(cls, batch: int, requests: list[dict], records: Sequence[StepRecord],
           bandwidth: float | None) -> BatchPoint:
        finish = max(r["finish"] for r in requests)
        start = min(r["arrival"] for r in requests)
        tokens = sum(r["output_tokens"] for r in requests)
        itls = [x for r in requests for x in r["itls"]]
        full = [r for r in records if r.dt and len(r.plan) == batch
                and all(e.num_new_tokens == 1 for e in r.plan)]
        step = statistics.median(r.dt for r in full) if full else None
        read = statistics.median(r.bytes_read for r in full) if full else None
        mbu = read / step / bandwidth if step and read and bandwidth else None
        return cls(batch, tokens / (finish - start) if finish > start else 0.0,
                   statistics.fmean(r["ttft"] for r in requests),
                   statistics.fmean(itls) if itls else 0.0, step, read, mbu)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


BatchRunner = Callable[[list[Arrival]], tuple[list[dict], list[StepRecord], float | None]]
"""arrivals → (their request metrics, every step record, the memory bandwidth or None)."""


def batch_sweep(run: BatchRunner, batches: Sequence[int], prompt_len: int, output_len: int,
                progress: Callable[[str], None] = lambda _: None) -> list[BatchPoint]:
    """Each batch size's point, ascending."""
    points = []
    for b in sorted(batches):
        requests, records, bandwidth = run(batch_arrivals(b, prompt_len, output_len))
        points.append(BatchPoint.of(b, requests, records, bandwidth))
        progress(f"batch {b}: {points[-1].throughput_tps:,.0f} tok/s")
    return points


ModeRunner = Callable[[list[Arrival], dict], dict]
"""(arrivals, the mode's knobs) → the run's summary."""


def admission_sweep(run: ModeRunner, modes: Sequence[str], arrivals: Sequence[Arrival],
                    rates: Sequence[float], progress: Callable[[str], None] = lambda _: None
                    ) -> dict[str, list[SweepPoint]]:
    """Per admission mode, the rate sweep's points (no cap re-run)."""
    out = {}
    for mode in modes:
        knobs = ADMISSION_MODES[mode]
        progress(f"{mode}:")
        out[mode] = sweep(lambda items, _cap, knobs=knobs: run(items, knobs), arrivals, rates,
                          check_cap=False, progress=progress).points
    return out

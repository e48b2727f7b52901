"""The step record: one engine iteration as it is recorded — the plan, what finished,
arrived and forked, the KV events and transfers — with its JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from kvdeck.runtime.core.checkpoint import RequestState
from kvdeck.runtime.core.step_data import SchedulerOutput, StepResult
from kvdeck.runtime.core.switch import Switch
from kvdeck.runtime.errors import RunFormatError
from kvdeck.runtime.kv.events import KVEvent, kv_event_from_json, kv_event_to_json
from kvdeck.runtime.kv.transfers import Transfer

_new_tuple = tuple.__new__


class PlanEntry(NamedTuple):
    """One request's share of a step: `num_new_tokens` from position `start`."""

    request_id: str
    start: int
    num_new_tokens: int
    sampled: int
    """Tokens the step emitted for the request: 0 or 1, or up to `draft + 1` when it
    speculated."""
    draft: int = 0
    """Draft tokens verified (then `num_new_tokens = 1 + draft`); written only when > 0."""


class Forked(NamedTuple):
    """A running request branched: the child shares the parent's blocks and tokens — or,
    for a `branch` (another sample of the prompt, `n` > 1), the parent's prompt and a first
    token of its own, drawn in the step that computed the prompt."""

    request_id: str
    parent_id: str
    max_tokens: int
    branch: bool = False


class Finished(NamedTuple):
    """A request that reached a final state during the step, and when."""

    request_id: str
    status: str
    reason: str | None
    time: float
    correct: bool | None = None
    """Whether its answer passed its check (`runtime/text/checks.py`); None: it carried none.
    Written only when not None, so runs without checks read as before."""


@dataclass(slots=True)
class StepRecord:
    """One engine iteration. Lists are empty and `dt` is None when the step did not run the
    executor (it only admitted arrivals, applied knobs or rejected requests)."""

    kind: ClassVar[str] = "step"
    step: int
    t0: float = 0.0
    """Engine time at the start of the step."""
    dt: float | None = None
    """Step duration (modelled under `sim`, measured otherwise)."""
    measured: bool = False
    bytes_read: int = 0
    padding: int = 0
    """Rows run beyond the step's tokens to fill an execution shape (a CUDA graph)."""
    num_decode: int = 0
    """Plan entries that were decodes (one token each); the rest of the plan is prefill."""
    resident: int = 0
    """Requests waiting or running while the step executed (Little's law)."""
    limit: str | None = None
    """Why no more waiting requests joined the step (see `SchedulerOutput.limit`)."""
    end: float | None = None
    """Engine time the step's tokens were stamped with, when it is not `t0 + dt`: on the
    wall clock a step also spends time scheduling and updating around the executor."""
    plan: list[PlanEntry] = field(default_factory=list)
    tokens: list[tuple[str, int]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    cow: list[tuple[int, int]] = field(default_factory=list)
    knobs: dict[str, Any] = field(default_factory=dict)
    """Knob changes applied at the start of this step."""
    arrived: list[RequestState] = field(default_factory=list)
    forked: list[Forked] = field(default_factory=list)
    """Branches made since the last step (their KV events come first in `kv`)."""
    kv: list[KVEvent] = field(default_factory=list)
    queue: tuple[int, int] = (0, 0)
    """(waiting, running) after the step."""
    switches: list[Switch] = field(default_factory=list)
    """Pauses between iterations to re-encode the KV pool, re-pack weights or move them
    (`core/switches.py`)."""
    transfers: list[Transfer] = field(default_factory=list)
    """Copies between device and host the step made (swaps, demotions, promotions, weight
    prefetches)."""
    swapped: list[str] = field(default_factory=list)
    """Of `preempted`, the requests whose KV was swapped out to the host (the rest
    recompute)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Requests whose KV went for good since the last record — preempted to recompute (by
    the plan or a switch) or their host copy lost — and the positions each had computed:
    recomputing those is waste (`stats/waste.py`)."""
    draft_s: float = 0.0
    """Of `dt`, the time a draft model spent drafting (speculative decoding)."""
    predicted_s: float | None = None
    """The timing model's prediction of the step's compute time, made when it was planned
    (the measured or modelled time is `dt`)."""
    itl_target_s: float = 0.0
    """The ITL target the step was planned under (0: none; `step_budget.py`)."""
    forecasts: dict[str, float] = field(default_factory=dict)
    """Admission control's latest predicted finish time of each running request, made when
    a request was admitted this step."""

    def ran(self, plan: SchedulerOutput, result: StepResult, t1: float) -> None:
        """Fill in what the executed `plan` and its `result` say, the step ending at `t1`
        (the one place a plan and a result are copied into the record)."""
        timing = result.timing
        self.dt, self.measured, self.bytes_read = timing.seconds, timing.measured, \
            timing.bytes_read
        self.padding = timing.padded_rows
        if t1 != self.t0 + timing.seconds:
            self.end = t1
        self.predicted_s, self.itl_target_s = plan.predicted_s, plan.itl_target_s
        self.draft_s = result.draft_seconds
        self.transfers = list(result.transfers)
        make = _new_tuple  # every chunk, every step: the tuple without the keyword wrapper
        self.plan = [make(PlanEntry, (c.request.request_id, c.start, c.num_new_tokens,
                                      c.emitted, c.num_draft)) for c in plan.chunks]
        self.tokens = list(result.sampled.items())
        for c in plan.chunks:  # speculating requests: the tokens they took, in order
            if c.num_draft and c.emitted:
                self.tokens.extend((c.request_id, t)
                                   for t in result.spec[c.request_id][:c.emitted])
        self.errors = dict(result.errors)
        self.admitted, self.preempted = list(plan.admitted), list(plan.preempted)
        self.swapped = list(plan.swapped)
        self.forecasts = dict(plan.forecasts)
        self.rejected = list(plan.rejected)
        self.cow = list(plan.cow_copies)
        self.num_decode = plan.num_decode_tokens
        self.limit = plan.limit

    @property
    def t1(self) -> float:
        return self.end if self.end is not None else self.t0 + (self.dt or 0.0)

    @property
    def num_prefill(self) -> int:
        return sum(e.num_new_tokens for e in self.plan) - self.num_decode

    @property
    def is_empty(self) -> bool:
        """Nothing happened: no record is written for such a step."""
        return not (self.plan or self.knobs or self.arrived or self.finished or self.rejected
                    or self.forked or self.kv or self.switches or self.transfers
                    or self.preempted)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"kind": self.kind, "step": self.step, "t0": self.t0}
        if self.dt is not None:
            d.update(dt=self.dt, measured=self.measured, bytes=self.bytes_read,
                     decode=self.num_decode, resident=self.resident)
            if self.limit:
                d["limit"] = self.limit
            if self.end is not None:
                d["t1"] = self.end
            if self.draft_s:
                d["draft_s"] = self.draft_s
            if self.predicted_s is not None:
                d["predicted_s"] = self.predicted_s
            if self.itl_target_s:
                d["itl_target_s"] = self.itl_target_s
            if self.padding:
                d["padding"] = self.padding
        if self.plan:
            d["plan"] = [list(e) if e.draft else list(e[:4]) for e in self.plan]
        for name in ("tokens", "errors", "admitted", "preempted", "rejected",
                     "finished", "cow", "knobs", "forked", "switches", "transfers", "swapped",
                     "forecasts", "dropped"):
            value = getattr(self, name)
            if value:
                d[name] = [list(x) for x in value] if isinstance(value, list) and \
                    isinstance(value[0], tuple) else value
        if self.switches:  # in its place among the keys
            d["switches"] = [sw.to_json() for sw in self.switches]
        if self.finished:  # in its place among the keys; the flag only where checked
            d["finished"] = [list(f) if f.correct is not None else list(f[:4])
                             for f in self.finished]
        if self.arrived:
            d["arrived"] = [r.arrival_json() for r in self.arrived]
        if self.kv:
            d["kv"] = [kv_event_to_json(e) for e in self.kv]
        d["queue"] = list(self.queue)
        return d

    @classmethod
    def from_json(cls, d: dict, where: str) -> StepRecord:
        try:
            return cls(
                step=d["step"], t0=d["t0"], dt=d.get("dt"), measured=d.get("measured", False),
                bytes_read=d.get("bytes", 0), padding=d.get("padding", 0),
                num_decode=d.get("decode", 0),
                resident=d.get("resident", 0), limit=d.get("limit"), end=d.get("t1"),
                plan=[PlanEntry(*x) for x in d.get("plan", [])],
                tokens=[(rid, tok) for rid, tok in d.get("tokens", [])],
                errors=dict(d.get("errors", {})),
                admitted=list(d.get("admitted", [])), preempted=list(d.get("preempted", [])),
                rejected=list(d.get("rejected", [])),
                finished=[Finished(*x) for x in d.get("finished", [])],
                cow=[(s, t) for s, t in d.get("cow", [])], knobs=dict(d.get("knobs", {})),
                arrived=[RequestState(*x) for x in d.get("arrived", [])],
                forked=[Forked(*x) for x in d.get("forked", [])],
                kv=[kv_event_from_json(e, where) for e in d.get("kv", [])],
                queue=tuple(d.get("queue", (0, 0))),
                switches=[Switch.from_json(x) for x in d.get("switches", [])],
                transfers=[Transfer(*x) for x in d.get("transfers", [])],
                swapped=list(d.get("swapped", [])), draft_s=d.get("draft_s", 0.0),
                predicted_s=d.get("predicted_s"), itl_target_s=d.get("itl_target_s", 0.0),
                forecasts=dict(d.get("forecasts", {})), dropped=dict(d.get("dropped", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RunFormatError(f"{where} is not a valid step record ({type(e).__name__}: "
                                 f"{e}).") from None

"""Typed records: KV events, iteration records, checkpoints and inbox messages, each with
its JSON form.

The engine produces them, the recorder writes their JSON forms one per line
(`iterations.jsonl`), and replay reads them back through `parse_record`, which refuses a
kind it does not know with one sentence instead of skipping it. This module is data only:
it imports nothing from the engine or the KV manager, so every layer can use it.

KV events (what `BlockManager` and `PrefixTree` did, in order):

    Ref(rid, index, block)        table[rid][index] = block (a new entry, or a replacement)
    Unref(rid, index, block)      the entry at `index` (always the last) is dropped
    Cow(rid, src, dst)            block `src` was copied into `dst` (already in the table)
    Cache(node, parent, block, end_token)   the block entered the prefix tree
    Evict(node, block)            the prefix tree dropped a block no request used
    Hit(rid, num_tokens)          an admission reused `num_tokens` cached tokens
    Reserve(rid, delta)           change in blocks promised to rid (full reservation)
    Relayout(num_blocks, bytes_per_block, moves)   the pool was re-laid (a KV format
                                  change): used block `old` now lives at `new` for each
                                  [old, new] in `moves`, and the pool has `num_blocks` blocks

Host-tier events (`kv/tiers.py`; device blocks still come and go by Ref/Unref/Cache/Evict):

    SwapOut(rid, pairs)           rid's computed blocks were copied out, [device, host] per
                                  table entry in order; Unrefs of its device table follow
    SwapIn(rid, pairs)            rid's host blocks were copied back, [host, device] each
                                  (its Refs come first); the host blocks are free again
    Unswap(rid)                   rid's host copy was dropped: it will recompute instead
    Demote(node, block, host)     a cached block left the device for host block `host`
    Promote(node, host, block, hit)   a demoted block came back to device block `block`
                                  (hit 1: a host hit, copied back; 0: a request computed the
                                  same block); `Evict` of a host-resident node (block −1)
                                  frees its host block
    HostResize(num_blocks)        the host tier (empty) was re-laid at a new block size
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

from kvdeck.runtime.errors import KvdeckError, RunFormatError
from kvdeck.runtime.request import Progress, RequestStatus

RUN_FORMAT = 2
"""Version of the run-directory format; a run written in another version is refused."""


# -- KV events --------------------------------------------------------------------------------

class Ref(NamedTuple):
    request_id: str
    index: int
    block: int
    kind = "ref"


class Unref(NamedTuple):
    request_id: str
    index: int
    block: int
    kind = "unref"


class Cow(NamedTuple):
    request_id: str
    src: int
    dst: int
    kind = "cow"


class Cache(NamedTuple):
    node_id: int
    parent_id: int
    block: int
    end_token: int
    kind = "cache"


class Evict(NamedTuple):
    node_id: int
    block: int
    kind = "evict"


class Hit(NamedTuple):
    request_id: str
    num_tokens: int
    kind = "hit"


class Reserve(NamedTuple):
    request_id: str
    delta: int
    kind = "reserve"


class Relayout(NamedTuple):
    num_blocks: int
    bytes_per_block: int
    moves: list[list[int]]
    kind = "relayout"


class SwapOut(NamedTuple):
    request_id: str
    pairs: list[list[int]]
    kind = "swap_out"


class SwapIn(NamedTuple):
    request_id: str
    pairs: list[list[int]]
    kind = "swap_in"


class Unswap(NamedTuple):
    request_id: str
    kind = "unswap"


class Demote(NamedTuple):
    node_id: int
    block: int
    host_block: int
    kind = "demote"


class Promote(NamedTuple):
    node_id: int
    host_block: int
    block: int
    hit: int
    """1: a lookup hit it (copied back); 0: a request computed the same block itself."""
    kind = "promote"


class HostResize(NamedTuple):
    num_blocks: int
    kind = "host_resize"


class WinRef(NamedTuple):
    """A request's sliding-window block `index` now holds `pages` (one per local sub-group,
    `kv/groups.py`): appended, or replacing the pages there (copy-on-write, a cached twin)."""

    request_id: str
    index: int
    pages: list[int]
    kind = "win_ref"


class WinUnref(NamedTuple):
    """A request dropped its sliding-window block `index`: behind the window (freed in
    place) or at the end of its table (truncated or released)."""

    request_id: str
    index: int
    pages: list[int]
    kind = "win_unref"


class WinCache(NamedTuple):
    """The prefix cache keeps node `node_id`'s sliding-window pages."""

    node_id: int
    pages: list[int]
    kind = "win_cache"


class WinEvict(NamedTuple):
    """The prefix cache dropped node `node_id`'s sliding-window pages (the node stays)."""

    node_id: int
    kind = "win_evict"


KVEvent = (Ref | Unref | Cow | Cache | Evict | Hit | Reserve | Relayout | SwapOut | SwapIn
           | Unswap | Demote | Promote | HostResize | WinRef | WinUnref | WinCache | WinEvict)
KV_EVENTS: dict[str, type] = {c.kind: c for c in (Ref, Unref, Cow, Cache, Evict, Hit, Reserve,
                                                   Relayout, SwapOut, SwapIn, Unswap, Demote,
                                                   Promote, HostResize, WinRef, WinUnref,
                                                   WinCache, WinEvict)}


def kv_event_to_json(ev: KVEvent) -> list:
    return [ev.kind, *ev]


def kv_event_from_json(item: Any, where: str) -> KVEvent:
    if not isinstance(item, list) or not item:
        raise RunFormatError(f"{where} has a KV event that is not a list: {item!r}.")
    cls = KV_EVENTS.get(item[0])
    if cls is None:
        raise RunFormatError(f"{where} has an unknown KV event kind {item[0]!r}; kinds are "
                             f"{', '.join(KV_EVENTS)}.")
    if len(item) != len(cls._fields) + 1:
        raise RunFormatError(f"{where} has a {item[0]!r} event with {len(item) - 1} fields; "
                             f"it takes {len(cls._fields)} ({', '.join(cls._fields)}).")
    return cls(*item[1:])


# -- iteration records ------------------------------------------------------------------------

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


class Transfer(NamedTuple):
    """One copy between device and host during a step (`StepResult.transfers`)."""

    kind: str
    """`swap` (a preempted request's KV), `demote` / `promote` (a cached prefix block),
    `weights` (an offloaded layer's FFN matrices)."""
    direction: str
    """`d2h` or `h2d`."""
    what: str
    """The request id, `node N`, or `layer N ffn`."""
    blocks: int
    """KV blocks copied (0 for weights)."""
    bytes: int
    start: float
    """Seconds from the start of the step (modelled under `sim`, measured otherwise)."""
    seconds: float
    bound: float
    """The lower bound `bytes / link bandwidth`."""
    stall: float
    """Seconds the step waited for this copy: all of it for KV copies (they precede the
    forward pass) and for weights with one buffer; with two, only what the compute of the
    layer before did not hide."""


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
    """Whether its answer passed its check (`runtime/checks.py`); None: it carried none.
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
    switches: list[dict[str, Any]] = field(default_factory=list)
    """Pauses between iterations to re-encode the KV pool or re-pack weights, each
    {knob, from, to, seconds, bytes, ...} (see `Engine._switch_kv`)."""
    transfers: list[Transfer] = field(default_factory=list)
    """Copies between device and host the step made (swaps, demotions, promotions, weight
    prefetches)."""
    swapped: list[str] = field(default_factory=list)
    """Of `preempted`, the requests whose KV was swapped out to the host (the rest
    recompute)."""
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
                    or self.forked or self.kv or self.switches or self.transfers)

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
        if self.plan:
            d["plan"] = [list(e) if e.draft else list(e[:4]) for e in self.plan]
        for name in ("tokens", "errors", "admitted", "preempted", "rejected",
                     "finished", "cow", "knobs", "forked", "switches", "transfers", "swapped",
                     "forecasts"):
            value = getattr(self, name)
            if value:
                d[name] = [list(x) for x in value] if isinstance(value, list) and \
                    isinstance(value[0], tuple) else value
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
                bytes_read=d.get("bytes", 0), num_decode=d.get("decode", 0),
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
                switches=[dict(x) for x in d.get("switches", [])],
                transfers=[Transfer(*x) for x in d.get("transfers", [])],
                swapped=list(d.get("swapped", [])), draft_s=d.get("draft_s", 0.0),
                predicted_s=d.get("predicted_s"), itl_target_s=d.get("itl_target_s", 0.0),
                forecasts=dict(d.get("forecasts", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RunFormatError(f"{where} is not a valid step record ({type(e).__name__}: "
                                 f"{e}).") from None


@dataclass(eq=False)
class RequestState(Progress):
    """A request as an iteration trace knows it: no tokens, every count and time.

    Replay keeps one per request and `request_metrics` reads it exactly as it reads a live
    `Request` (the shared `Progress` fields), so replayed timings are computed by the same
    code. A step record's `arrived` list holds each arriving request's initial state.
    """

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    deadline: float | None
    priority: int
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def arrival_json(self) -> list:
        """The compact form a step record's `arrived` list holds."""
        return [self.request_id, self.arrival_time, self.num_prompt_tokens, self.max_tokens,
                self.deadline, self.priority]

    def to_json(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestState:
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        values["status"] = RequestStatus(values.get("status", "waiting"))
        return cls(**values)


@dataclass
class Checkpoint:
    """The engine's state when a recording starts mid-run: requests in flight with their
    progress and block tables, the prefix tree, reservations, knobs and the running
    figures — everything replay needs to continue from here as if it had seen it all."""

    kind: ClassVar[str] = "checkpoint"
    step: int
    time: float
    knobs: dict[str, Any]
    requests: list[RequestState]
    tables: dict[str, list[int]]
    reserved: dict[str, int]
    nodes: list[list]
    """[node id, parent id, block, end token, hits, last access, created lookup, host block,
    window pages] per cached block, parents before children (block −1 for one on the host
    tier, host block −1 for one on the device; older runs lack the host block and the
    window pages)."""
    tree: dict[str, int]
    """Prefix-tree counters: lookups, query tokens, hit tokens, evictions."""
    counters: dict[str, int]
    """Engine counters: preemptions, copy-on-write copies."""
    figures: dict[str, Any]
    """`figures.RunFigures.to_json()`."""
    pool: dict[str, int] | None = None
    """The pool's `num_blocks` and `bytes_per_block` then (they change with the KV format);
    None: the run header's."""
    switches: list[dict[str, Any]] = field(default_factory=list)
    """The latest KV/weight format switches before it (what the console still shows)."""
    host: dict[str, Any] | None = None
    """The host tier: `num_blocks`, `tables` (swapped requests' host blocks), swap counters
    and the transfer log (`transfers.TransferLog.to_json`); None in older runs."""
    spec: dict[str, Any] | None = None
    """Speculative decoding's counters (`spec.stats.SpecStats.to_json`); None in older
    runs."""
    window_tables: dict[str, list[list[int]]] | None = None
    """With `free_window_kv`: each running request's sliding-window page tables (−1 where
    freed); None otherwise."""

    def to_json(self) -> dict:
        d = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            d[f.name] = [r.to_json() for r in value] if f.name == "requests" else value
        return d

    @classmethod
    def from_json(cls, d: dict, where: str) -> Checkpoint:
        try:
            optional = {"pool": None, "switches": [], "host": None, "spec": None,
                        "window_tables": None}
            values = {f.name: d[f.name] for f in fields(cls) if f.name not in optional}
            values.update({k: d.get(k, v) for k, v in optional.items()})
            values["requests"] = [RequestState.from_json(r) for r in values["requests"]]
            return cls(**values)
        except (KeyError, TypeError) as e:
            raise RunFormatError(f"{where} is not a valid checkpoint ({type(e).__name__}: "
                                 f"{e}).") from None


@dataclass(frozen=True)
class Truncated:
    """The recorder reached its size bound at this step and wrote nothing after it."""

    kind: ClassVar[str] = "truncated"
    step: int

    def to_json(self) -> dict:
        return {"kind": self.kind, "step": self.step}

    @classmethod
    def from_json(cls, d: dict, where: str) -> Truncated:
        return cls(d.get("step", 0))


RECORDS: dict[str, type] = {c.kind: c for c in (StepRecord, Checkpoint, Truncated)}
Record = StepRecord | Checkpoint | Truncated


def dumps(data: Any) -> str:
    """Compact, deterministic JSON (insertion-ordered keys, repr floats)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


def json_object(line: str, where: str, error: type[KvdeckError]) -> dict:
    """One line of a JSONL file as a dict; `error(sentence)` naming `where` if it is not."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON ({e.msg}).") from None
    if not isinstance(d, dict):
        raise error(f"{where} is not a JSON object.")
    return d


def parse_record(line: str, where: str) -> Record:
    """One line of `iterations.jsonl` as a typed record; a RunFormatError names `where` and
    the problem for bad JSON or an unknown kind."""
    d = json_object(line, where, RunFormatError)
    cls = RECORDS.get(d.get("kind"))
    if cls is None:
        raise RunFormatError(f"{where} has an unknown record kind {d.get('kind')!r}; this "
                             f"kvdeck reads {', '.join(RECORDS)} records.")
    return cls.from_json(d, where)


# -- inbox messages -----------------------------------------------------------------------------

@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request (its arrival may lie in the future)."""

    request: Any
    """A `request.Request`."""

    def to_json(self) -> dict:
        r = self.request
        return {"kind": "add", "request_id": r.request_id, "arrival_time": r.arrival_time,
                "prompt_tokens": r.num_prompt_tokens, "max_tokens": r.sampling.max_tokens}


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str

    def to_json(self) -> dict:
        return {"kind": "abort", "request_id": self.request_id, "reason": self.reason}


@dataclass(frozen=True)
class SetKnobs:
    """Knobs to apply from the next iteration (already validated), and what changed."""

    knobs: Any
    """A `config.Knobs`."""
    changes: dict[str, Any]

    def to_json(self) -> dict:
        return {"kind": "knobs", "changes": self.changes}


@dataclass(frozen=True)
class Pause:
    def to_json(self) -> dict:
        return {"kind": "pause"}


@dataclass(frozen=True)
class Resume:
    def to_json(self) -> dict:
        return {"kind": "resume"}


@dataclass(frozen=True)
class Watch:
    """Put this request's timeline in every snapshot (None: stop)."""

    request_id: str | None

    def to_json(self) -> dict:
        return {"kind": "watch", "request_id": self.request_id}


@dataclass(frozen=True)
class SetPriority:
    """Change a queued or running request's priority (lower runs first)."""

    request_id: str
    priority: int

    def to_json(self) -> dict:
        return {"kind": "priority", "request_id": self.request_id, "priority": self.priority}


@dataclass(frozen=True)
class StepOnce:
    """While paused, run this many iterations."""

    count: int = 1

    def to_json(self) -> dict:
        return {"kind": "step", "count": self.count}


@dataclass(frozen=True)
class StartRecording:
    """Attach a recorder at the next iteration boundary; it starts with a checkpoint."""

    recorder: Any
    """A `recording.Recorder`."""

    def to_json(self) -> dict:
        return {"kind": "record", "run_dir": str(self.recorder.run_dir)}


@dataclass(frozen=True)
class StopRecording:
    def to_json(self) -> dict:
        return {"kind": "stop-recording"}


InboxMessage = AddRequest | Abort | SetKnobs | Pause | Resume | StepOnce | StartRecording \
    | StopRecording | Watch | SetPriority

"""The checkpoint: the whole engine state a recording starts from (and writes every few
hundred steps), with its JSON form."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from kvdeck.runtime.core.request import Occupancy, Progress, Request, RequestStatus
from kvdeck.runtime.core.switch import Switch
from kvdeck.runtime.errors import RunFormatError
from kvdeck.runtime.kv.state import KVState
from kvdeck.runtime.kv.transfers import TransferLog, host_checkpoint


@dataclass(eq=False, slots=True)
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
    lora: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""

    @classmethod
    def arriving(cls, req: Request) -> RequestState:
        """An arriving request's initial state (a step record's `arrived` entry)."""
        return cls(req.request_id, req.arrival_time, req.num_prompt_tokens,
                   req.sampling.max_tokens, req.deadline, req.priority, lora=req.sampling.lora)

    @classmethod
    def of(cls, req: Request) -> RequestState:
        """A live request's state, as a checkpoint keeps it."""
        progress = {f.name: getattr(req, f.name) for f in fields(Progress)}
        progress["token_times"] = list(req.token_times)
        progress["occupancy"] = dataclasses.replace(req.occupancy)
        return cls(req.request_id, req.arrival_time, req.num_prompt_tokens,
                   req.sampling.max_tokens, req.deadline, req.priority,
                   num_output_tokens=req.num_output_tokens, lora=req.sampling.lora,
                   **progress)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def arrival_json(self) -> list:
        """The compact form a step record's `arrived` list holds (with an adapter: then 0
        output tokens and its name, so runs recorded before read as they were)."""
        return [self.request_id, self.arrival_time, self.num_prompt_tokens, self.max_tokens,
                self.deadline, self.priority, *((0, self.lora) if self.lora else ())]

    def to_json(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestState:
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        values["status"] = RequestStatus(values.get("status", "waiting"))
        if "occupancy" in values:  # runs recorded before it have none
            values["occupancy"] = Occupancy(**values["occupancy"])
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
    switches: list[Switch] = field(default_factory=list)
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
            d[f.name] = [r.to_json() for r in value] if f.name in ("requests", "switches") \
                else value
        return d

    @classmethod
    def from_json(cls, d: dict, where: str) -> Checkpoint:
        try:
            optional = {"pool": None, "switches": [], "host": None, "spec": None,
                        "window_tables": None}
            values = {f.name: d[f.name] for f in fields(cls) if f.name not in optional}
            values.update({k: d.get(k, v) for k, v in optional.items()})
            values["requests"] = [RequestState.from_json(r) for r in values["requests"]]
            values["switches"] = [Switch.from_json(sw) for sw in values["switches"]]
            return cls(**values)
        except (KeyError, TypeError) as e:
            raise RunFormatError(f"{where} is not a valid checkpoint ({type(e).__name__}: "
                                 f"{e}).") from None


def checkpoint_of(kv: KVState, *, step: int, time: float, knobs: dict[str, Any],
                  requests: list[RequestState], counters: dict[str, int],
                  figures: dict[str, Any], switches: list[Switch],
                  transfer_log: TransferLog, spec: dict[str, Any]) -> Checkpoint:
    """The checkpoint of a KV state and what the engine (or replay) keeps beside it: the
    one builder the live engine and replay share, so the two write the same record."""
    return Checkpoint(
        step=step, time=time, knobs=knobs, requests=requests, counters=counters,
        figures=figures, switches=switches, spec=spec, **kv.checkpoint_fields(),
        pool={"num_blocks": kv.pool.num_blocks, "bytes_per_block": kv.bytes_per_block},
        host=host_checkpoint(kv.host.num_blocks, kv.host_tables, kv.num_swap_outs,
                             kv.num_swap_ins, transfer_log))

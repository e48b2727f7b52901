"""The checkpoint: the whole engine state a recording starts from (and writes every few
hundred steps), with its JSON form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from kvdeck.runtime.core.request import Progress, RequestStatus
from kvdeck.runtime.errors import RunFormatError


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

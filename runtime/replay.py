"""Rebuild engine state from an iteration trace alone — no model, no engine.

`TraceState.apply(record)` advances one step: block refcounts, cache flags and block tables
from the KV events; request progress and states from the plan, admissions, preemptions and
finishes. `block_states()` packs the same per-block codes as a live `EngineSnapshot`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.snapshot import block_states


@dataclass
class ReplayRequest:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    max_tokens: int
    deadline: float | None
    priority: int
    status: str = "waiting"
    computed_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class TraceState:
    """The state after the last applied step record."""

    num_blocks: int
    block_size: int
    refcount: list[int] = field(default_factory=list)
    cached: bytearray = field(default_factory=bytearray)
    tables: dict[str, list[int]] = field(default_factory=dict)
    requests: dict[str, ReplayRequest] = field(default_factory=dict)
    num_reserved: int = 0
    step: int = -1
    time: float = 0.0
    knob_changes: list[tuple[int, dict]] = field(default_factory=list)

    @classmethod
    def from_header(cls, header: dict) -> TraceState:
        n = header["num_blocks"]
        return cls(n, header["block_size"], [0] * n, bytearray(n))

    def apply(self, rec: dict) -> None:
        self.step = rec["step"]
        self.time = rec.get("t0", self.time) + rec.get("dt", 0.0)
        if "knobs" in rec:
            self.knob_changes.append((self.step, rec["knobs"]))
        for rid, t, n, max_tokens, deadline, priority in rec.get("arrived", []):
            self.requests[rid] = ReplayRequest(rid, t, n, max_tokens, deadline, priority)
        for ev in rec.get("kv", []):
            self._apply_kv(ev)
        for rid in rec.get("admitted", []):
            self.requests[rid].status = "running"
        for rid, start, n, sample in rec.get("plan", []):
            r = self.requests[rid]
            r.computed_tokens = start + n
            r.output_tokens += sample
        for rid in rec.get("preempted", []):
            r = self.requests[rid]
            r.status, r.computed_tokens = "preempted", 0
        for rid, status, _reason in rec.get("finished", []):
            if rid in self.requests:
                self.requests[rid].status = status

    def _apply_kv(self, ev: list) -> None:
        kind = ev[0]
        if kind == "ref":
            _, rid, idx, block = ev
            table = self.tables.setdefault(rid, [])
            if idx == len(table):
                table.append(block)
            else:  # replacement (copy-on-write or dedupe): the old entry's reference goes
                self.refcount[table[idx]] -= 1
                table[idx] = block
            self.refcount[block] += 1
        elif kind == "unref":
            _, rid, idx, block = ev
            table = self.tables[rid]
            assert table[idx] == block and idx == len(table) - 1
            table.pop()
            if not table:
                del self.tables[rid]
            self.refcount[block] -= 1
        elif kind == "cache":
            block = ev[3]
            self.refcount[block] += 1
            self.cached[block] = 1
        elif kind == "evict":
            block = ev[2]
            self.refcount[block] -= 1
            self.cached[block] = 0
        elif kind == "hit":
            _, rid, n = ev
            self.requests[rid].cached_tokens = n
            self.requests[rid].computed_tokens = n
        elif kind == "reserve":
            self.num_reserved += ev[2]

    def block_states(self) -> bytes:
        return block_states(self.refcount, self.cached)

"""Rebuild engine state from an iteration trace alone — no model, no engine.

`TraceState.apply(record)` advances one step: block refcounts, cache flags and block tables
from the KV events; request progress and states from the plan, admissions, preemptions and
finishes; the prefix tree from cache and evict events. `block_states()` packs the same
per-block codes as a live `EngineSnapshot`, and `snapshot(header)` builds a whole one, so
the console's panels can show any recorded iteration.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.config import Knobs
from runtime.kv.prefix_tree import NodeSummary
from runtime.metrics import Distribution
from runtime.snapshot import (
    CACHED,
    FREE,
    BatchView,
    EngineSnapshot,
    KVView,
    RequestView,
    block_states,
)


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
    admitted_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


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
    knobs: dict = field(default_factory=dict)
    cache_nodes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """node id -> (parent node id, block, end token) for every cached block."""
    last_batch: BatchView | None = None
    finished: deque = field(default_factory=lambda: deque(maxlen=256))
    """The most recent finished requests, for rolling latency figures."""
    counts: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_evictions: int = 0
    num_cow: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0

    @classmethod
    def from_header(cls, header: dict) -> TraceState:
        n = header["num_blocks"]
        state = cls(n, header["block_size"], [0] * n, bytearray(n))
        state.knobs = dict(header.get("config", {}).get("knobs", {}))
        return state

    def apply(self, rec: dict) -> None:
        self.step = rec["step"]
        self.time = rec.get("t0", self.time) + rec.get("dt", 0.0)
        if "knobs" in rec:
            self.knob_changes.append((self.step, rec["knobs"]))
            self.knobs.update(rec["knobs"])
        for rid, t, n, max_tokens, deadline, priority in rec.get("arrived", []):
            self.requests[rid] = ReplayRequest(rid, t, n, max_tokens, deadline, priority)
        for ev in rec.get("kv", []):
            self._apply_kv(ev)
        for rid in rec.get("admitted", []):
            r = self.requests[rid]
            r.status = "running"
            if r.admitted_time is None:
                r.admitted_time = rec.get("t0", self.time)
        plan = rec.get("plan", [])
        decode = prefill = 0
        for rid, start, n, sample in plan:
            r = self.requests[rid]
            is_decode = start >= r.prompt_tokens and n == 1
            decode, prefill = decode + n * is_decode, prefill + n * (not is_decode)
            r.computed_tokens = start + n
            r.output_tokens += sample
            if sample:
                r.token_times.append(self.time)
        for rid in rec.get("preempted", []):
            r = self.requests[rid]
            r.status, r.computed_tokens = "preempted", 0
            r.num_preemptions += 1
            self.num_preemptions += 1
        self.num_cow += len(rec.get("cow", []))
        if plan:
            k = Knobs(**self.knobs) if self.knobs else Knobs()
            self.last_batch = BatchView(self.step, decode, prefill, len(plan),
                                        k.max_num_batched_tokens, k.max_num_seqs,
                                        rec.get("dt", 0.0), len(rec.get("preempted", [])))
        for rid, status, _reason in rec.get("finished", []):
            self.counts[status] = self.counts.get(status, 0) + 1
            r = self.requests.pop(rid, None)
            if r is not None:
                r.status = status
                self.finished.append((r, self.time))

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
            _, node, parent, block, end = ev
            self.refcount[block] += 1
            self.cached[block] = 1
            self.cache_nodes[node] = (parent, block, end)
        elif kind == "evict":
            _, node, block = ev
            self.refcount[block] -= 1
            self.cached[block] = 0
            self.cache_nodes.pop(node, None)
            self.num_evictions += 1
        elif kind == "hit":
            _, rid, n = ev
            r = self.requests[rid]
            r.cached_tokens = r.computed_tokens = n
            self.hit_tokens += n
            self.query_tokens += r.prompt_tokens + r.output_tokens - 1
        elif kind == "reserve":
            self.num_reserved += ev[2]

    def block_states(self) -> bytes:
        return block_states(self.refcount, self.cached)

    # -- snapshot -----------------------------------------------------------------------------

    def prefix_segments(self, limit: int = 256) -> tuple[NodeSummary, ...]:
        """Cached blocks as folded segments, as the live prefix-tree summary shows them
        (hit counts are not in the trace and show as 0)."""
        children: dict[int, list[int]] = {}
        for node, (parent, _, _) in self.cache_nodes.items():
            children.setdefault(parent, []).append(node)
        out: list[NodeSummary] = []
        stack = [(n, 0) for n in sorted(children.get(0, []), reverse=True)]
        p = self.block_size
        while stack and len(out) < limit:
            first, parent_id = stack.pop()
            _, block, end = self.cache_nodes[first]
            users = self.refcount[block] - 1
            last, count = first, 1
            while len(children.get(last, [])) == 1:
                (child,) = children[last]
                if self.refcount[self.cache_nodes[child][1]] - 1 != users:
                    break
                last, count = child, count + 1
            start = end - p
            out.append(NodeSummary(first, parent_id, block, start, self.cache_nodes[last][2],
                                   count, users, 0, self.time, users == 0))
            stack.extend((c, first) for c in sorted(children.get(last, []), reverse=True))
        return tuple(out)

    def _view(self, r: ReplayRequest) -> RequestView:
        return RequestView(r.request_id, r.status, r.prompt_tokens, r.computed_tokens,
                           r.output_tokens, r.max_tokens, r.cached_tokens, r.arrival_time,
                           r.admitted_time, r.deadline, r.priority, r.num_preemptions,
                           tuple(self.tables.get(r.request_id, ())))

    def snapshot(self, header: dict) -> EngineSnapshot:
        """The console's view of the engine after the last applied record."""
        states = self.block_states()
        free = states.count(FREE)
        cached_only = states.count(CACHED)
        kv = KVView(self.num_blocks, self.block_size, header.get("kv_format", "?"),
                    header.get("bytes_per_block", 0), states, free, cached_only,
                    self.num_reserved, 1 - free / self.num_blocks, sum(self.cached),
                    self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                    self.num_evictions, self.num_cow)
        live = [r for r in self.requests.values() if r.arrival_time <= self.time]
        done = list(self.finished)
        ttft = [r.token_times[0] - r.arrival_time for r, _ in done if r.token_times]
        itl = [b - a for r, _ in done for a, b in zip(r.token_times, r.token_times[1:],
                                                      strict=False)]
        tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                for r, _ in done if len(r.token_times) > 1]
        e2e = [t - r.arrival_time for r, t in done if r.status.startswith("finished")]
        return EngineSnapshot(
            step=self.step + 1, time=self.time, model_name=header.get("model", "?"),
            executor=f"replay of {header.get('executor', '?')}",
            knobs=Knobs(**self.knobs) if self.knobs else Knobs(),
            waiting=tuple(self._view(r) for r in live if r.status != "running"),
            running=tuple(self._view(r) for r in live if r.status == "running"),
            batch=self.last_batch, kv=kv, prefix_nodes=self.prefix_segments(),
            num_finished=self.counts.get("finished_stopped", 0)
            + self.counts.get("finished_length", 0),
            num_rejected=self.counts.get("rejected", 0),
            num_aborted=self.counts.get("aborted", 0),
            num_preemptions=self.num_preemptions,
            recent={"ttft": Distribution.of(ttft), "itl": Distribution.of(itl),
                    "tpot": Distribution.of(tpot), "e2e": Distribution.of(e2e),
                    "good_fraction": None, "mean_resident": None,
                    "littles_prediction": None},
        )

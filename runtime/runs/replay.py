"""Rebuild engine state from an iteration trace alone — no model, no engine.

`TraceState.apply(record)` advances one step with the same pieces the live engine uses:
KV events go into a `BlockStates` (refcounts, cache flags and the packed block map) and a
`PrefixTree` (nodes restored by the trace's ids, hits and recency from the same events);
request progress comes from the plan, admissions, preemptions and finishes into
`RequestState`s, whose timings `metrics.request_metrics` reads exactly as it reads live
requests; and the running figures are a `RunFigures` fed with the same step figures. So a
replayed snapshot shows what the live console showed at that step.

A run recorded mid-run starts with a `Checkpoint` record, from which the state is restored
before the first step is applied.
"""

from __future__ import annotations

import dataclasses

from kvdeck.runtime.core.checkpoint import Checkpoint, RequestState
from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.request import RequestStatus
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.errors import RunFormatError
from kvdeck.runtime.kv.block_pool import BlockStates
from kvdeck.runtime.kv.events import (
    Cache,
    Cow,
    Demote,
    Evict,
    Hit,
    HostResize,
    Promote,
    Ref,
    Relayout,
    Reserve,
    SwapIn,
    SwapOut,
    Unref,
    Unswap,
    WinCache,
    WinEvict,
    WinRef,
    WinUnref,
)
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.prefix_tree import PrefixTree
from kvdeck.runtime.kv.tiers import HOST_DEMOTED, HOST_SWAPPED, HostTier
from kvdeck.runtime.kv.transfers import TransferLog, TransfersView, host_checkpoint
from kvdeck.runtime.kv.window import move_window_pages
from kvdeck.runtime.spec.stats import SpecStats
from kvdeck.runtime.views.figures import RunFigures, kv_summary, step_figures, summarize
from kvdeck.runtime.views.metrics import SLO, RequestMetrics, request_metrics
from kvdeck.runtime.views.snapshot import (
    BatchView,
    EngineSnapshot,
    KVView,
    RequestView,
    window_view,
)


class TraceState:
    """The state after the last applied record."""

    def __init__(self, header: dict):
        self.header = header
        n, p = header["num_blocks"], header["block_size"]
        self.num_blocks, self.block_size = n, p
        self.host = HostTier(header.get("host_blocks", 0))
        self.host_tables: dict[str, list[int]] = {}
        self._new_tree(BlockStates(n, p))
        self.bytes_per_block = header.get("bytes_per_block", 0)
        self.transfer_log = TransferLog()
        self.offload: str = header.get("offload", "")
        self.offload_gain_bytes: int = header.get("offload_gain_bytes", 0)
        self.num_swapped = 0
        self.spec = SpecStats()
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.tables: dict[str, list[int]] = {}
        self.window_tables: dict[str, list[list[int]]] = {}
        """With `free_window_kv`: the sliding-window page tables (`kv/window.py`)."""
        groups = header.get("layer_groups")
        self.groups = LayerGroups(groups["num_layers"], tuple(groups["local_layers"]),
                                  groups["window"]) if groups else None
        self.page_groups = bytearray(n)
        self.requests: dict[str, RequestState] = {}
        self.reserved: dict[str, int] = {}
        self.num_reserved = 0
        self.step = -1
        self.time = 0.0
        self.knobs: dict = dict(header.get("config", {}).get("knobs", {}))
        self.knob_changes: list[tuple[int, dict]] = []
        self.last_batch: BatchView | None = None
        self.figures = RunFigures()
        self.num_preemptions = 0
        self.num_cow = 0
        self.switches: list[dict] = []
        self.finished: list[RequestMetrics] = []
        """Every request that finished in the applied records, for `summarize_run` (not kept
        in checkpoints: scrubbing back does not need it)."""

    def _new_tree(self, pool: BlockStates) -> None:
        self.pool = pool
        self.tree = PrefixTree(pool)
        self.tree.host = self.host

    # -- checkpoints --------------------------------------------------------------------------

    def restore(self, cp: Checkpoint) -> None:
        """Start from a mid-run checkpoint (before any step record is applied)."""
        self.step, self.time = cp.step - 1, cp.time
        self.knobs = dict(cp.knobs)
        if cp.host is not None and cp.host["num_blocks"] != self.host.num_blocks:
            self.host.resize(cp.host["num_blocks"])
        if cp.pool is not None and cp.pool["num_blocks"] != self.num_blocks:
            self.num_blocks = cp.pool["num_blocks"]
            self._new_tree(BlockStates(self.num_blocks, self.block_size))
        if cp.pool is not None:
            self.bytes_per_block = cp.pool["bytes_per_block"]
        self.switches = list(cp.switches)
        for sw in self.switches:
            if sw["knob"] == "offload_layers":
                self.offload, self.offload_gain_bytes = sw["offload"], sw["gain"]
        self.tree.load(cp.nodes, cp.tree)
        if len(self.page_groups) != self.num_blocks:
            self.page_groups = bytearray(self.num_blocks)
        for node in self.tree.nodes.values():
            for page in node.local:
                self.page_groups[page] = 1
        for rid, table in cp.tables.items():
            self.tables[rid] = list(table)
            for block in table:
                self.pool.incref(block)
                self.tree.on_block_used(block)
        for rid, wt in (cp.window_tables or {}).items():
            self.window_tables[rid] = [list(t) for t in wt]
            for table in wt:
                for page in table:
                    if page >= 0:
                        self.pool.incref(page)
                        self.tree.on_block_used(page)
                        self.page_groups[page] = 1
        self.reserved = dict(cp.reserved)
        self.num_reserved = sum(cp.reserved.values())
        self.num_preemptions = cp.counters["preemptions"]
        self.num_cow = cp.counters["cow"]
        self.num_swapped = cp.counters.get("swapped", 0)
        if cp.spec is not None:
            self.spec.load(cp.spec)
        if cp.host is not None:
            for rid, hosts in cp.host["tables"].items():
                self.host_tables[rid] = list(hosts)
                for h in hosts:
                    self.host.occupy(h, HOST_SWAPPED)
            self.num_swap_outs = cp.host["counters"]["swap_outs"]
            self.num_swap_ins = cp.host["counters"]["swap_ins"]
            self.transfer_log.load(cp.host["transfers"])
        self.requests = {r.request_id: r for r in cp.requests}
        self.figures.load(cp.figures)

    def checkpoint(self) -> Checkpoint:
        """This state as a checkpoint (the replay console keeps some to scrub backwards)."""
        nodes, tree_counters = self.tree.export()
        return Checkpoint(
            step=self.step + 1, time=self.time, knobs=dict(self.knobs),
            requests=[dataclasses.replace(r, token_times=list(r.token_times))
                      for r in self.requests.values()],
            tables={rid: list(t) for rid, t in self.tables.items()},
            window_tables={rid: [list(t) for t in wt] for rid, wt in self.window_tables.items()}
            if self.groups else None,
            reserved=dict(self.reserved), nodes=nodes, tree=tree_counters,
            counters={"preemptions": self.num_preemptions, "cow": self.num_cow,
                      "swapped": self.num_swapped},
            figures=self.figures.to_json(),
            pool={"num_blocks": self.num_blocks, "bytes_per_block": self.bytes_per_block},
            switches=list(self.switches),
            host=host_checkpoint(self.host.num_blocks, self.host_tables, self.num_swap_outs,
                                 self.num_swap_ins, self.transfer_log),
            spec=self.spec.to_json())

    # -- steps --------------------------------------------------------------------------------

    def apply(self, rec: StepRecord) -> None:
        """Advance by one step record; a record that does not fit the state rebuilt so far
        (a damaged or hand-edited run) is a RunFormatError naming the step."""
        try:
            self._apply(rec)
        except (KeyError, IndexError, ValueError, AssertionError) as e:
            raise RunFormatError(f"Step {rec.step} does not fit the state the run rebuilt "
                                 f"before it ({type(e).__name__}: {e}); the run is damaged."
                                 ) from None

    def _apply(self, rec: StepRecord) -> None:
        self.step = rec.step
        self.time = rec.t1
        if rec.knobs:
            self.knob_changes.append((self.step, rec.knobs))
            self.knobs.update(rec.knobs)
        for a in rec.arrived:
            self.requests[a.request_id] = dataclasses.replace(a, token_times=[])
            self.figures.on_arrival(rec.t0 - a.arrival_time)
        for f in rec.forked:
            parent = self._request(f.parent_id, rec)
            child = dataclasses.replace(
                parent, request_id=f.request_id, max_tokens=f.max_tokens, num_cached_tokens=0,
                num_preemptions=0, token_times=list(parent.token_times))
            if f.branch:  # another sample: the prompt, and its first token from this step
                child.token_times, child.num_output_tokens = [rec.t1], 1
                child.first_token_time = rec.t1
                child.num_computed_tokens = parent.num_prompt_tokens
                child.status = RequestStatus.RUNNING
                child.admitted_time = parent.admitted_time if parent.admitted_time \
                    is not None else rec.t0
            self.requests[f.request_id] = child
        for sw in rec.switches:  # requests preempted to fit a re-laid pool
            for rid in sw.get("preempted", ()):
                self._preempted(rid, rec)
            self.switches = [*self.switches[-7:], {**sw, "step": rec.step}]
            if sw["knob"] == "offload_layers":
                self.offload, self.offload_gain_bytes = sw["offload"], sw["gain"]
        for rid in rec.admitted:
            r = self._request(rid, rec)
            swapped_in = r.status is RequestStatus.SWAPPED
            r.status = RequestStatus.RUNNING
            if swapped_in:  # resumes where it stopped (the plan says from where)
                continue
            r.num_computed_tokens = r.num_cached_tokens = 0
            if r.admitted_time is None:
                r.admitted_time = rec.t0
        for rid, t in rec.forecasts.items():
            r = self.requests.get(rid)
            if r is not None:
                r.predicted_finish = t
        for ev in rec.kv:
            self._apply_kv(ev, rec)
        t1 = rec.t1
        if rec.draft_s:
            self.spec.on_draft_step(rec.draft_s, rec.dt or 0.0)
        for rid, start, n, sample, draft in rec.plan:
            r = self._request(rid, rec)
            # A speculating entry keeps the KV of its input token and accepted drafts.
            r.num_computed_tokens = start + (sample if draft else n)
            if draft:
                self.spec.on_round(draft, min(sample - 1, draft), sample, rec.dt or 0.0)
            if sample and rid not in rec.errors:
                r.num_output_tokens += sample
                r.token_times.extend([t1] * sample)
                if r.first_token_time is None:
                    r.first_token_time = t1
        swapped = set(rec.swapped)
        for rid in rec.preempted:
            if rid in swapped:
                r = self._request(rid, rec)
                r.status = RequestStatus.SWAPPED
                r.num_preemptions += 1
                self.num_preemptions += 1
                self.num_swapped += 1
            else:
                self._preempted(rid, rec)
        self.num_cow += len(rec.cow)
        self.transfer_log.on_step(rec.step, rec.transfers)
        for f in rec.finished:
            r = self.requests.pop(f.request_id, None)
            if r is None:
                raise RunFormatError(f"Step {rec.step} finishes request {f.request_id!r}, "
                                     "which the run never introduced.")
            r.status, r.reason, r.finish_time = RequestStatus(f.status), f.reason, f.time
            r.correct = f.correct
            m = request_metrics(r)
            self.figures.on_finish(m)
            self.finished.append(m)
        if rec.dt is not None:
            k = Knobs(**self.knobs) if self.knobs else Knobs()
            self.last_batch = BatchView(rec.step, rec.num_decode, rec.num_prefill,
                                        len(rec.plan), k.max_num_batched_tokens,
                                        k.max_num_seqs, rec.dt, len(rec.preempted), rec.limit,
                                        rec.predicted_s, rec.itl_target_s)
            self.figures.on_step(step_figures(rec, self.usage,
                                              self.pool.num_cached_only / self.num_blocks,
                                              self.tree.hit_rate))

    def _preempted(self, rid: str, rec: StepRecord) -> None:
        r = self._request(rid, rec)
        r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
        r.num_preemptions += 1
        self.num_preemptions += 1

    def _request(self, rid: str, rec: StepRecord) -> RequestState:
        r = self.requests.get(rid)
        if r is None:
            raise RunFormatError(f"Step {rec.step} refers to request {rid!r}, which the run "
                                 "never introduced; the recording is incomplete.")
        return r

    def _apply_kv(self, ev, rec: StepRecord) -> None:
        pool, tree, step = self.pool, self.tree, rec.step
        if isinstance(ev, Ref):
            table = self.tables.setdefault(ev.request_id, [])
            pool.incref(ev.block)
            tree.on_block_used(ev.block)
            self.page_groups[ev.block] = 0
            if ev.index == len(table):
                table.append(ev.block)
            else:  # a replacement (copy-on-write, or a duplicate switched to the cached block)
                old, table[ev.index] = table[ev.index], ev.block
                node = tree.node_of_block.get(ev.block)
                if node is not None:
                    node.last_access = step  # the cache handed out an existing block
                self._drop(old, step)
        elif isinstance(ev, Unref):
            table = self.tables.get(ev.request_id)
            if not table or table[-1] != ev.block or ev.index != len(table) - 1:
                raise RunFormatError(f"Step {rec.step} drops block {ev.block} from "
                                     f"{ev.request_id!r}, which does not hold it last.")
            table.pop()
            if not table:
                del self.tables[ev.request_id]
            self._drop(ev.block, step)
        elif isinstance(ev, Cache):
            node = tree.restore(ev.node_id, ev.parent_id, ev.block, step, tree.num_lookups)
            assert node.depth_tokens == ev.end_token
        elif isinstance(ev, Evict):
            tree.evict(tree.nodes[ev.node_id])
        elif isinstance(ev, Hit):
            r = self._request(ev.request_id, rec)
            table = self.tables.get(ev.request_id, [])
            chain = [tree.node_of_block[b] for b in table[:ev.num_tokens // self.block_size]]
            tree.record_lookup(chain, r.num_tokens - 1, step)
            r.num_cached_tokens = r.num_computed_tokens = ev.num_tokens
        elif isinstance(ev, Reserve):
            self.num_reserved += ev.delta
            left = self.reserved.get(ev.request_id, 0) + ev.delta
            if left:
                self.reserved[ev.request_id] = left
            else:
                self.reserved.pop(ev.request_id, None)
        elif isinstance(ev, Cow):
            pass  # the Ref before it already moved the table entry; counted per step
        elif isinstance(ev, SwapOut):
            hosts = [h for _, h in ev.pairs]
            for h in hosts:
                self.host.occupy(h, HOST_SWAPPED)
            self.host_tables[ev.request_id] = hosts
            self.num_swap_outs += 1
        elif isinstance(ev, SwapIn):
            for h in self.host_tables.pop(ev.request_id):
                self.host.free(h)
            self.num_swap_ins += 1
        elif isinstance(ev, Unswap):
            for h in self.host_tables.pop(ev.request_id):
                self.host.free(h)
            r = self.requests.get(ev.request_id)
            if r is not None and r.status is RequestStatus.SWAPPED:
                r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
        elif isinstance(ev, Demote):
            node = tree.nodes[ev.node_id]
            assert node.block == ev.block, f"node {ev.node_id} is not in block {ev.block}"
            self.host.occupy(ev.host_block, HOST_DEMOTED)
            tree.demote_to(node, ev.host_block)
        elif isinstance(ev, Promote):
            tree.promote(tree.nodes[ev.node_id], ev.block, hit=bool(ev.hit))
        elif isinstance(ev, HostResize):
            self.host.resize(ev.num_blocks)
        elif isinstance(ev, WinRef | WinUnref | WinCache | WinEvict):
            self._apply_window(ev, rec)
        elif isinstance(ev, Relayout):
            moves = {old: new for old, new in ev.moves}
            pool.relayout(ev.num_blocks, moves)
            for table in self.tables.values():
                table[:] = [moves.get(b, b) for b in table]
            self.page_groups = move_window_pages(self.window_tables, self.page_groups, moves,
                                                 ev.num_blocks)
            tree.move_blocks(moves, ev.bytes_per_block)
            self.num_blocks, self.bytes_per_block = ev.num_blocks, ev.bytes_per_block

    def _apply_window(self, ev, rec: StepRecord) -> None:
        """A sliding-window event (`kv/window.py`), as the live manager applied it."""
        pool, tree = self.pool, self.tree
        if isinstance(ev, WinRef):
            wt = self.window_tables.setdefault(ev.request_id, [[] for _ in ev.pages])
            for table, page in zip(wt, ev.pages, strict=True):
                pool.incref(page)
                tree.on_block_used(page)
                self.page_groups[page] = 1
                while len(table) < ev.index:  # blocks a hit left behind its window
                    table.append(-1)
                if ev.index == len(table):
                    table.append(page)
                else:  # a replacement: copy-on-write, or a cached twin's pages
                    old, table[ev.index] = table[ev.index], page
                    if old >= 0:
                        self._drop(old, rec.step)
        elif isinstance(ev, WinUnref):
            wt = self.window_tables.get(ev.request_id)
            if not wt or len(wt[0]) <= ev.index or \
                    [t[ev.index] for t in wt] != list(ev.pages):
                raise RunFormatError(f"Step {rec.step} drops window pages {ev.pages} from "
                                     f"{ev.request_id!r}, which does not hold them there.")
            for table in wt:
                table[ev.index] = -1
                while table and table[-1] < 0:
                    table.pop()
            if not wt[0]:
                del self.window_tables[ev.request_id]
            for page in ev.pages:
                self._drop(page, rec.step)
        elif isinstance(ev, WinCache):
            for page in ev.pages:
                self.page_groups[page] = 1
            tree.attach_local(tree.nodes[ev.node_id], ev.pages, rec.step)
        else:
            tree.drop_local(tree.nodes[ev.node_id])

    def _drop(self, block: int, step: int) -> None:
        self.pool.decref(block)
        if self.pool.cached[block] and self.pool.refcount[block] == 1:
            self.tree.on_block_released(block, step)

    # -- views --------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.pool.num_held / self.num_blocks

    def block_states(self) -> bytes:
        return bytes(self.pool.states)

    def _view(self, r: RequestState) -> RequestView:
        return RequestView(r.request_id, r.status.value, r.num_prompt_tokens,
                           r.num_computed_tokens, r.num_output_tokens, r.max_tokens,
                           r.num_cached_tokens, r.arrival_time, r.admitted_time, r.deadline,
                           r.priority, r.num_preemptions,
                           tuple(self.tables.get(r.request_id, ())))

    def snapshot(self) -> EngineSnapshot:
        """The console's view of the engine after the last applied record."""
        h, tree = self.header, self.tree
        kv_format = self.knobs.get("kv_format", h.get("kv_format", "?"))
        kv = KVView(self.num_blocks, self.block_size, kv_format,
                    self.bytes_per_block, self.block_states(), self.pool.num_free,
                    self.pool.num_cached_only, self.num_reserved, self.usage, tree.num_nodes,
                    tree.hit_rate, tree.num_evictions, self.num_cow, tree.num_query_tokens,
                    tree.num_hit_tokens, (),
                    h.get("draft_kv_bytes_per_token", {}).get(kv_format, 0) * self.block_size,
                    h.get("draft_model", ""),
                    window_view(self.groups, self.pool.states, self.page_groups))
        live = [r for r in self.requests.values() if r.arrival_time <= self.time]
        counts = self.figures.status_counts
        knobs = Knobs(**self.knobs) if self.knobs else Knobs()
        return EngineSnapshot(
            step=self.step + 1, time=self.time, model_name=h.get("model", "?"),
            executor=f"replay of {h.get('executor', '?')}",
            knobs=knobs,
            waiting=tuple(self._view(r) for r in live if r.status is not RequestStatus.RUNNING),
            running=tuple(self._view(r) for r in live if r.status is RequestStatus.RUNNING),
            batch=self.last_batch, kv=kv, prefix_nodes=tuple(tree.summary()),
            num_finished=counts.get("finished_stopped", 0) + counts.get("finished_length", 0),
            num_rejected=counts.get("rejected", 0), num_aborted=counts.get("aborted", 0),
            num_preemptions=self.num_preemptions,
            recent=self.figures.rolling(), figures=self.figures.view(),
            switches=tuple(self.switches), transfers=self.transfers_view(),
            speculation=self.spec.view(knobs.speculative_method, knobs.num_speculative_tokens,
                                       h.get("draft_model", "")),
        )

    def transfers_view(self) -> TransfersView:
        log = self.transfer_log
        counters = log.view_counters(self.num_swap_outs, self.num_swap_ins, self.tree)
        h = self.header
        link = h.get("link_bandwidth", 0.0)
        return TransfersView(
            link, h.get("link", f"{link / 1e9:,.1f} GB/s"), self.host.num_blocks,
            self.host.num_swapped, self.host.num_demoted, self.bytes_per_block,
            bytes(self.host.states), tuple(self.host_tables), counters, log.last,
            tuple(log.recent), self.offload, self.offload_gain_bytes)

    def check_integrity(self) -> None:
        """The rebuilt pool and tree agree with each other and with the block tables."""
        self.host.check_integrity()
        assert self.host.num_swapped == sum(map(len, self.host_tables.values()))
        self.pool.check_integrity()
        self.tree.check_integrity()
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                counts[b] += 1
        for wt in self.window_tables.values():
            for table in wt:
                for b in table:
                    if b >= 0:
                        counts[b] += 1
        for b in range(self.num_blocks):
            assert self.pool.refcount[b] == counts[b] + self.pool.cached[b], f"block {b}"


class Replay:
    """A run's records split into its starting checkpoint and its steps, ready to replay."""

    def __init__(self, header: dict, records: list):
        self.header = header
        self.checkpoint: Checkpoint | None = None
        self.steps: list[StepRecord] = []
        self.truncated = False
        for i, rec in enumerate(records):
            if isinstance(rec, Checkpoint):
                if i != 0:
                    raise RunFormatError("A checkpoint record may only open a run; this run "
                                         f"has one at record {i + 1}.")
                self.checkpoint = rec
            elif isinstance(rec, StepRecord):
                self.steps.append(rec)
            else:  # Truncated: the recorder hit its size bound
                self.truncated = True

    def initial_state(self) -> TraceState:
        """The state before the first step record."""
        state = TraceState(self.header)
        if self.checkpoint is not None:
            state.restore(self.checkpoint)
        return state


def load_replay(run_dir) -> Replay:
    """Read a run directory for replay (one sentence if it cannot be replayed)."""
    # recording imports the engine; replay need not
    from kvdeck.runtime.runs.recording import read_run

    header, records = read_run(run_dir)
    replay = Replay(header, records)
    if not replay.steps and replay.checkpoint is None:
        raise RunFormatError(f"{run_dir} holds no iterations to replay.")
    # A recording started and stopped while paused holds only its checkpoint: the state then.
    return replay


def summarize_run(run_dir, slo: SLO = SLO()) -> dict:
    """A recorded run's summary, computed from its records alone by the code `run-trace`
    summarizes with (`figures.summarize` over the finished requests' metrics and the running
    figures), so the two agree on the same run. A recording started mid-run covers the
    requests that finished while it recorded."""
    replay = load_replay(run_dir)
    state = replay.initial_state()
    for rec in replay.steps:
        state.apply(rec)
    h = replay.header
    summary = summarize(state.finished, state.figures, slo)
    summary.update(kv_summary(h.get("executor", "?"), h.get("model", "?"), state.num_blocks,
                              state.block_size, h.get("bytes_per_block", 0), state.tree,
                              state.num_cow))
    summary.update(truncated=replay.truncated, unfinished=len(state.requests))
    return summary

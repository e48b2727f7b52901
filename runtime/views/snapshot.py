"""Immutable views of the engine after an iteration — the only thing the console, the
`/metrics` exporter and other consumers read; they never reach into the scheduler or the KV
manager.

Block states are the pool's packed state bytes (see `kv.block_pool`: FREE, PRIVATE, SHARED,
CACHED, CACHED_ACTIVE), copied, not recomputed. `SnapshotBuilder` builds snapshots
incrementally: request views are reused while a request has not changed, the prefix-tree
summary while the tree and its blocks' references have not, and latency percentiles while no
request has finished — so the engine thread can publish several snapshots a second under
load (`make bench` reports the cost). The engine never builds its own views (the core
imports no view); `snapshot_of(engine)` does, with one builder per engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.failure import EngineFailure
from kvdeck.runtime.core.request import Request, RequestStatus
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.core.switch import Switch
from kvdeck.runtime.executors.base import (
    Adapters,
    Modelled,
    WeightsView,
    auto_choice,
    draft_kv_bytes_per_token,
    has,
    offload_of,
)
from kvdeck.runtime.kv.block_pool import (
    CACHED,
    CACHED_ACTIVE,
    FREE,
    PRIVATE,
    SHARED,
    STATE_NAMES,
)
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.transfers import TransfersView
from kvdeck.runtime.kv.window import held_by_group
from kvdeck.runtime.planning.roofline import StepRoofline, executor_peaks
from kvdeck.runtime.spec.stats import SpeculationView
from kvdeck.runtime.stats.energy import EnergyMeter, energy_figures, modelled_energy
from kvdeck.runtime.stats.figures import FiguresView
from kvdeck.runtime.text.tokenizer import Tokenizer, forced_runs
from kvdeck.runtime.views.prefix import NodeSummary, summarize_tree

if TYPE_CHECKING:
    from kvdeck.runtime.core.engine import Engine

__all__ = ["CACHED", "CACHED_ACTIVE", "FREE", "PRIVATE", "SHARED", "STATE_NAMES",
           "BatchView", "EngineSnapshot", "KVView", "RequestDetail",
           "RequestView", "SnapshotBuilder", "TrackedOutput", "snapshot_builder", "snapshot_of"]
RECENT_FINISHED = 64
"""Finished requests a snapshot lists."""
STATUS_VALUES = {s: s.value for s in RequestStatus}
"""A status's string by dict lookup: an Enum's `.value` goes through a descriptor, about
1 µs a call, for every running request in every snapshot."""


class RequestView(NamedTuple):
    """One request as a snapshot shows it. A tuple: a snapshot builds one for every request
    that changed, every running one each step, up to ten times a second (a frozen dataclass
    sets each field through `object.__setattr__`, several times slower to build)."""

    request_id: str
    status: str
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int
    cached_tokens: int
    arrival_time: float
    admitted_time: float | None
    deadline: float | None
    priority: int
    num_preemptions: int
    block_table: tuple[int, ...]
    occupancy: tuple[float, int, float, int] = (0.0, 0, 0.0, 0)
    """`Occupancy.values()`: prefill seconds and tokens, decode seconds and calls."""
    lora: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""

    @property
    def accelerator_s(self) -> float:
        """`t_GPU = L/r_P + (G − 1)/r_D`: the accelerator seconds it occupied so far."""
        return self.occupancy[0] + self.occupancy[2]

    @property
    def prefill_new(self) -> int:
        return self.occupancy[1]

    @property
    def decode_calls(self) -> int:
        return self.occupancy[3]

    @property
    def r_P(self) -> float | None:  # noqa: N802 - the chapter's name
        """Its prefill rate: new tokens per accelerator second (None before any)."""
        prefill_s, new = self.occupancy[:2]
        return new / prefill_s if prefill_s > 0 else None

    @property
    def r_D(self) -> float | None:  # noqa: N802 - the chapter's name
        """Its decode rate: decode calls per accelerator second (None before any)."""
        decode_s, calls = self.occupancy[2:]
        return calls / decode_s if decode_s > 0 else None


@dataclass(frozen=True)
class BatchView:
    """The last iteration's composition against its budgets."""

    step: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    token_budget: int
    max_num_seqs: int
    seconds: float
    num_preempted: int
    limit: str | None = None
    """Why no more waiting requests joined (None: nobody was left waiting)."""
    predicted_s: float | None = None
    """The timing model's prediction of `seconds`, made when the step was planned."""
    itl_target_s: float = 0.0
    """The ITL target the step was planned under (0: none)."""
    padding: int = 0
    """Rows run beyond the step's tokens to fill an execution shape (a CUDA graph)."""

    @classmethod
    def of(cls, rec: StepRecord, token_budget: int, max_num_seqs: int) -> BatchView:
        """The batch of step record `rec` (one that ran), planned under these limits."""
        return cls(rec.step, rec.num_decode, rec.num_prefill, len(rec.plan), token_budget,
                   max_num_seqs, rec.dt or 0.0, len(rec.preempted), rec.limit,
                   rec.predicted_s, rec.itl_target_s, rec.padding)

    @property
    def unused_budget(self) -> int:
        return max(self.token_budget - self.num_decode_tokens - self.num_prefill_tokens, 0)


@dataclass(frozen=True)
class WindowView:
    """The pool's two layer groups under `free_window_kv` (`kv/groups.py`)."""

    layout: str
    """`LayerGroups.describe()`: the layers of each group, the window, the page."""
    page_groups: bytes
    """Per page, 1 for a sliding-window page (meaningful for pages in use)."""
    full_pages: int
    """Pages requests hold for the full-attention layers."""
    window_pages: int
    """Pages requests hold for the sliding-window layers."""


def window_view(groups: LayerGroups | None, states: bytes | bytearray,
                page_groups: bytearray) -> WindowView | None:
    """The two groups as a snapshot shows them (live or replayed); None without groups."""
    if groups is None:
        return None
    full, window = held_by_group(states, page_groups)
    return WindowView(groups.describe(), bytes(page_groups), full, window)


@dataclass(frozen=True)
class KVView:
    num_blocks: int
    block_size: int
    kv_format: str
    bytes_per_block: int
    states: bytes
    num_free: int
    num_evictable: int
    num_reserved: int
    usage: float
    """Blocks held by requests / pool (vLLM's `kv_cache_usage_perc`)."""
    num_cached_blocks: int
    hit_rate: float
    num_evictions: int
    num_cow_copies: int
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    formats: tuple[str, ...] = ()
    """The KV formats the executor can switch the pool to (the `kv_format` knob's choices)."""
    draft_bytes_per_block: int = 0
    """Bytes of each block's twin in the draft model's pool (0 without a draft model)."""
    draft_model: str = ""
    window: WindowView | None = None
    """The two layer groups when sliding-window KV is freed (blocks are then pages)."""
    eviction: str = ""
    """Token-level eviction's policy and count (`TokenEvictor.describe`; "" when off)."""
    num_evicted_blocks: int = 0
    """Blocks token-level eviction dropped from requests' tables so far."""

    @property
    def cached_fraction(self) -> float:
        """Blocks only the prefix cache holds (free for allocation) / pool."""
        return self.num_evictable / self.num_blocks if self.num_blocks else 0.0

    def count(self, state: int) -> int:
        return self.states.count(state)


@dataclass(frozen=True)
class TrackedOutput:
    """A request someone follows (the console's prompt): its text so far."""

    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    text: str
    reason: str | None
    constraint: str | None = None
    """What its output follows (`guided.GuideSpec.label`), if constrained."""
    segments: tuple[tuple[str, bool], ...] = ()
    """A constrained output's text in runs of (text, forced): forced runs are tokens the
    grammar left no choice about (keys, punctuation)."""
    branches: tuple[TrackedOutput, ...] = ()
    """Its other samples (`n` > 1), once started."""


@dataclass(frozen=True)
class RequestDetail:
    """One watched request's whole story (the console's request detail)."""

    request_id: str
    status: str
    reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    priority: int
    events: tuple[tuple[float, str], ...]
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything the console shows, as of the end of iteration `step`."""

    step: int
    time: float
    """Engine clock (virtual seconds under `sim`)."""
    model_name: str
    executor: str
    knobs: Knobs
    waiting: tuple[RequestView, ...]
    running: tuple[RequestView, ...]
    batch: BatchView | None
    kv: KVView
    prefix_nodes: tuple[NodeSummary, ...]
    num_finished: int
    num_rejected: int
    num_aborted: int
    num_preemptions: int
    recent: dict
    """Rolling metrics over recently finished requests (see `RunFigures.rolling`)."""
    figures: FiguresView | None = None
    paused: bool = False
    failure: EngineFailure | None = None
    lag_s: float = 0.0
    """Virtual seconds a paced sim is behind the wall clock (0 when keeping up)."""
    energy: dict | None = None
    """`stats.energy.energy_figures`: joules, joules per good result and their source."""
    pending_knobs: Knobs | None = None
    """Knobs submitted but not applied yet (they apply at the next iteration)."""
    tracked: tuple[TrackedOutput, ...] = ()
    finished: tuple[RequestView, ...] = ()
    """The most recently finished requests, newest last (the console's request table)."""
    detail: RequestDetail | None = None
    """The watched request (see `commands.Watch`), wherever it is in its life."""
    weights: WeightsView | None = None
    switches: tuple[Switch, ...] = ()
    """The latest pauses to re-encode the KV pool or re-pack weights, oldest first, each a
    `StepRecord.switches` entry plus the step it happened before."""
    transfers: TransfersView | None = None
    """The host tier, the link and what crossed it (`runtime/kv/transfers.py`)."""
    speculation: SpeculationView | None = None
    """Speculative decoding's method and acceptance (`runtime/spec/stats.py`)."""
    roofline: StepRoofline | None = None
    """The last step against the machine's roofline (`runtime/planning/roofline.py`): on
    the sim, its card's; elsewhere None until this machine's peaks are measured."""


def tracked_output(req: Request, tokenizer: Tokenizer | None) -> TrackedOutput:
    """A followed request's text (forced runs marked when constrained) and its
    branches'."""
    text = req.output_text
    if text is None:
        text = " ".join(map(str, req.output_token_ids))
    guide = req.guide
    segments = forced_runs(tokenizer, req.prompt_token_ids, req.output_token_ids,
                           guide.forced) if guide is not None and tokenizer else ()
    branches = tuple(tracked_output(b, tokenizer) for b in req.branches
                     if b.status is not RequestStatus.WAITING)
    return TrackedOutput(req.request_id, req.status.value, req.num_prompt_tokens,
                         req.num_output_tokens, req.sampling.max_tokens, text, req.reason,
                         req.sampling.guide.label if req.sampling.guide else None,
                         segments, branches)


class SnapshotBuilder:
    """Builds an engine's snapshots, reusing what has not changed since the last one."""

    def __init__(self, engine: Engine):
        self._engine = weakref.ref(engine)
        """Weak: the builders of `snapshot_of` are kept per engine in a weak-keyed table, and
        a strong reference back would keep every engine (and its model) alive."""
        self._views: dict[str, tuple[tuple, RequestView]] = {}
        self._prefix: tuple[tuple[int, int, int], tuple[NodeSummary, ...]] | None = None
        ex = engine.executor  # an engine keeps its executor: its peaks are worked out once
        self._peaks = executor_peaks(ex)
        self._power = (ex.hardware.name, ex.hardware.power_watts) if has(ex, Modelled) \
            else None
        self._meter = None if self._power is not None else EnergyMeter.probe()

    @property
    def engine(self) -> Engine:
        engine = self._engine()
        assert engine is not None, "the engine of this snapshot builder is gone"
        return engine

    def _request_views(self, requests, tables: dict[str, list[int]],
                       fresh: dict[str, tuple[tuple, RequestView]]) -> tuple[RequestView, ...]:
        out = []
        old = self._views
        for r in requests:
            rid = r.request_id
            table = tables.get(rid)
            key = (r.status, r.num_computed_tokens, len(r.output_token_ids), r.num_preemptions,
                   r.num_cached_tokens, len(table) if table is not None else -1)
            hit = old.get(rid)
            if hit is None or hit[0] != key:
                occ = r.occupancy
                hit = (key, RequestView(
                    rid, STATUS_VALUES[r.status], len(r.prompt_token_ids), r.num_computed_tokens,
                    len(r.output_token_ids), r.sampling.max_tokens, r.num_cached_tokens,
                    r.arrival_time, r.admitted_time, r.deadline, r.priority,
                    r.num_preemptions, tuple(table) if table else (),
                    (occ.prefill_s, occ.prefill_new, occ.decode_s, occ.decode_calls),
                    r.sampling.lora))
            fresh[rid] = hit
            out.append(hit[1])
        return tuple(out)

    def _watched(self) -> RequestDetail | None:
        e = self.engine
        req = e.watched
        if req is None:
            return None
        table = e.kv.tables.get(req.request_id)
        return RequestDetail(req.request_id, req.status.value, req.reason,
                             req.num_prompt_tokens, req.num_output_tokens,
                             req.num_cached_tokens, req.priority, tuple(req.events),
                             tuple(table) if table else ())

    def _prefix_nodes(self, limit: int) -> tuple[NodeSummary, ...]:
        kv = self.engine.kv
        key = (kv.tree.version, kv.pool.cache_version, limit)
        if self._prefix is None or self._prefix[0] != key:
            self._prefix = (key, tuple(summarize_tree(kv.tree, limit)))
        return self._prefix[1]

    def _weights(self) -> WeightsView:
        view = self.engine.switcher.weights_view
        executor = self.engine.executor
        if has(executor, Adapters):  # loads and unloads change it between switches
            view = dataclasses.replace(view, adapters=executor.describe_adapters())
        if "auto" not in view.formats:
            return view
        return dataclasses.replace(view, auto=auto_choice(executor))

    def kv_view(self) -> KVView:
        e = self.engine
        kv, tree = e.kv, e.kv.tree
        return KVView(kv.num_blocks, kv.block_size, e.switcher.kv_format, kv.bytes_per_block,
                      bytes(kv.pool.states), kv.pool.num_free, tree.num_evictable,
                      kv.num_reserved, kv.usage, tree.num_nodes, tree.hit_rate,
                      tree.num_evictions, kv.num_cow_copies, tree.num_query_tokens,
                      tree.num_hit_tokens, e.executor.info.kv_formats,
                      draft_kv_bytes_per_token(e.executor, e.switcher.kv_format)
                      * kv.block_size,
                      e.executor.info.draft_model_name,
                      window_view(kv.groups, kv.pool.states, kv.page_groups),
                      kv.eviction.describe(), kv.eviction.num_evicted_blocks)

    def transfers_view(self) -> TransfersView:
        e = self.engine
        kv, log, tree = e.kv, e.transfer_log, e.kv.tree
        return TransfersView(
            e.executor.info.link_bandwidth, e.executor.info.link_detail, kv.host.num_blocks,
            kv.host.num_swapped, kv.host.num_demoted, kv.bytes_per_block, bytes(kv.host.states),
            tuple(kv.host_tables), log.view_counters(kv.num_swap_outs, kv.num_swap_ins, tree),
            log.last, tuple(log.recent),
            *offload_of(e.executor))

    def build(self, max_prefix_nodes: int = 256) -> EngineSnapshot:
        """Call from the engine thread (or while it is stopped)."""
        e = self.engine
        sched = e.scheduler
        tables = e.kv.tables
        fresh: dict[str, tuple[tuple, RequestView]] = {}
        waiting = self._request_views(sched.waiting, tables, fresh)
        running = self._request_views(sched.running, tables, fresh)
        done = e.completed
        finished = self._request_views(
            itertools.islice(done, max(len(done) - RECENT_FINISHED, 0), None), tables, fresh)
        self._views = fresh
        counts = e.figures.status_counts
        pending = e.submitted_knobs if e.submitted_knobs != sched.knobs else None
        return EngineSnapshot(
            step=e.step_count,
            time=e.clock.now() if e.state_end is None else e.state_end,
            model_name=e.executor.info.model_name, executor=e.executor.info.name,
            knobs=sched.knobs, waiting=waiting, running=running,
            batch=BatchView.of(*e.last_step) if e.last_step else None, kv=self.kv_view(),
            prefix_nodes=self._prefix_nodes(max_prefix_nodes),
            num_finished=counts.get("finished_stopped", 0) + counts.get("finished_length", 0),
            num_rejected=counts.get("rejected", 0), num_aborted=counts.get("aborted", 0),
            num_preemptions=sched.num_preemptions,
            recent=e.figures.rolling(), figures=e.figures.view(),
            paused=e.paused, failure=e.failure, lag_s=e.clock.lag_s, pending_knobs=pending,
            tracked=tuple(tracked_output(r, e.tokenizer) for r in e.tracked.values()),
            finished=finished, detail=self._watched(),
            switches=tuple(e.switcher.recent), weights=self._weights(),
            transfers=self.transfers_view(),
            speculation=sched.spec.view(sched.knobs.speculative_method,
                                        sched.knobs.num_speculative_tokens,
                                        e.executor.info.draft_model_name),
            roofline=self._roofline(), energy=self._energy(e.figures),
        )

    def _energy(self, figures) -> dict:
        """`energy_figures` live: the sim's modelled from its busy time; a real executor's
        from the machine's counters since this builder was made (its first snapshot)."""
        good = figures.num_good
        if self._power is not None:
            return modelled_energy(figures.busy_seconds, *self._power, good)
        return energy_figures(self._meter.joules(), self._meter.source + (
            ", since the first snapshot" if self._meter.readable else ""), good)

    def _roofline(self) -> StepRoofline | None:
        """The last step against the executor's peaks (`roofline.executor_peaks`)."""
        last = self.engine.last_step
        return self._peaks.step(last[0]) if self._peaks is not None and last else None


_BUILDERS: weakref.WeakKeyDictionary[Engine, SnapshotBuilder] = weakref.WeakKeyDictionary()
"""One builder per engine, so what one snapshot built is reused by the next."""


def snapshot_builder(engine: Engine) -> SnapshotBuilder:
    """The builder of `engine`'s snapshots (made on first use, gone with the engine)."""
    builder = _BUILDERS.get(engine)
    if builder is None:
        builder = _BUILDERS[engine] = SnapshotBuilder(engine)
    return builder


def snapshot_of(engine: Engine, max_prefix_nodes: int = 256) -> EngineSnapshot:
    """An immutable view of `engine` now; call from the engine thread (or while it is
    stopped)."""
    return snapshot_builder(engine).build(max_prefix_nodes)

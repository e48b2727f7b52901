"""Rebuild engine state from an iteration trace alone — no model, no engine.

`TraceState.apply(record)` advances one step with the same pieces the live engine uses:
KV events go into a `KVState` through the `apply` the live block manager changes it with
(refcounts, cache flags, the packed block map, every table, the host tier and the prefix
tree, whose nodes replay keys by the trace's ids); request progress comes from the plan,
admissions, preemptions and finishes into `RequestState`s, whose timings
`metrics.request_metrics` reads exactly as it reads live requests; and the running figures
are a `RunFigures` fed with the same step figures. So a replayed snapshot shows what the
live console showed at that step.

A run recorded mid-run starts with a `Checkpoint` record, from which the state is restored
before the first step is applied.
"""

from __future__ import annotations

import dataclasses

from kvdeck.runtime.core.checkpoint import Checkpoint, RequestState, checkpoint_of
from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.request import Occupancy, RequestStatus
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.core.switch import RECENT, Switch
from kvdeck.runtime.errors import RunFormatError
from kvdeck.runtime.kv.block_pool import BlockStates
from kvdeck.runtime.kv.events import Hit, Unswap
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.state import KVState
from kvdeck.runtime.kv.transfers import TransferLog, TransfersView
from kvdeck.runtime.planning.roofline import Peaks
from kvdeck.runtime.spec.stats import SpecStats
from kvdeck.runtime.stats.energy import energy_figures, modelled_energy
from kvdeck.runtime.stats.figures import RunFigures, kv_summary, step_figures, summarize
from kvdeck.runtime.stats.metrics import SLO, RequestMetrics, request_metrics
from kvdeck.runtime.views.prefix import summarize_tree
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
        self.block_size = header["block_size"]
        groups = header.get("layer_groups")
        self.groups = LayerGroups(groups["num_layers"], tuple(groups["local_layers"]),
                                  groups["window"]) if groups else None
        self._new_kv(header["num_blocks"], header.get("host_blocks", 0),
                     header.get("bytes_per_block", 0))
        self.transfer_log = TransferLog()
        self.offload: str = header.get("offload", "")
        self.offload_gain_bytes: int = header.get("offload_gain_bytes", 0)
        self.num_swapped = 0
        self.spec = SpecStats()
        self.requests: dict[str, RequestState] = {}
        self.step = -1
        self.time = 0.0
        self.knobs: dict = dict(header.get("config", {}).get("knobs", {}))
        self.knob_changes: list[tuple[int, dict]] = []
        self.last_batch: BatchView | None = None
        self.last_ran: StepRecord | None = None
        """The last record of a step that ran (the roofline readout's)."""
        self.peaks = _peaks(header)
        self.figures = RunFigures()
        self.num_preemptions = 0
        self.num_cow = 0
        self.switches: list[Switch] = []
        self.finished: list[RequestMetrics] = []
        """Every request that finished in the applied records, for `summarize_run` (not kept
        in checkpoints: scrubbing back does not need it)."""

    def _new_kv(self, num_blocks: int, host_blocks: int, bytes_per_block: int) -> None:
        """An empty KV state (`kv/state.py`), changed by the trace's events only."""
        self.kv = KVState(BlockStates(num_blocks, self.block_size), host_blocks=host_blocks,
                          groups=self.groups, clock=lambda: self.step, record=False,
                          bytes_per_block=bytes_per_block)
        kv = self.kv
        self.pool, self.tree, self.host = kv.pool, kv.tree, kv.host
        self.tables, self.window_tables, self.host_tables = \
            kv.tables, kv.window_tables, kv.host_tables

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # -- checkpoints --------------------------------------------------------------------------

    def restore(self, cp: Checkpoint) -> None:
        """Start from a mid-run checkpoint (before any step record is applied)."""
        self.step, self.time = cp.step - 1, cp.time
        self.knobs = dict(cp.knobs)
        pool, host = cp.pool or {}, cp.host or {}
        self._new_kv(pool.get("num_blocks", self.num_blocks),
                     host.get("num_blocks", self.host.num_blocks),
                     pool.get("bytes_per_block", self.kv.bytes_per_block))
        self.switches = list(cp.switches)
        for sw in self.switches:
            if sw.knob == "offload_layers":
                self.offload, self.offload_gain_bytes = sw.offload, sw.gain
        self.kv.restore(cp.tables, cp.window_tables, cp.reserved, cp.nodes, cp.tree,
                        host.get("tables", {}))
        self.num_preemptions = cp.counters["preemptions"]
        self.num_cow = cp.counters["cow"]
        self.num_swapped = cp.counters.get("swapped", 0)
        if cp.spec is not None:
            self.spec.load(cp.spec)
        if cp.host is not None:
            self.kv.num_swap_outs = cp.host["counters"]["swap_outs"]
            self.kv.num_swap_ins = cp.host["counters"]["swap_ins"]
            self.transfer_log.load(cp.host["transfers"])
        # Copies: the checkpoint stays as it was (the replay console scrubs back to it).
        self.requests = {r.request_id: dataclasses.replace(
            r, token_times=list(r.token_times), occupancy=dataclasses.replace(r.occupancy))
            for r in cp.requests}
        self.figures.load(cp.figures)

    def checkpoint(self) -> Checkpoint:
        """This state as a checkpoint (the replay console keeps some to scrub backwards)."""
        return checkpoint_of(
            self.kv, step=self.step + 1, time=self.time, knobs=dict(self.knobs),
            requests=[dataclasses.replace(r, token_times=list(r.token_times),
                                          occupancy=dataclasses.replace(r.occupancy))
                      for r in self.requests.values()],
            counters={"preemptions": self.num_preemptions, "cow": self.num_cow,
                      "swapped": self.num_swapped},
            figures=self.figures.to_json(), switches=list(self.switches),
            transfer_log=self.transfer_log, spec=self.spec.to_json())

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
        """The record's parts in the order the live step made them."""
        self.step = rec.step
        self.time = rec.t1
        self._arrivals(rec)
        self._kv_events(rec)
        self._progress(rec)
        self._endings(rec)

    def _arrivals(self, rec: StepRecord) -> None:
        """Knob changes, arrivals, forks, switches and admissions at the step's start."""
        if rec.knobs:
            self.knob_changes.append((self.step, rec.knobs))
            self.knobs.update(rec.knobs)
        for a in rec.arrived:
            self.requests[a.request_id] = dataclasses.replace(a, token_times=[],
                                                              occupancy=Occupancy())
            self.figures.on_arrival(rec.t0 - a.arrival_time)
        for f in rec.forked:
            parent = self._request(f.parent_id, rec)
            child = dataclasses.replace(
                parent, request_id=f.request_id, max_tokens=f.max_tokens, num_cached_tokens=0,
                num_preemptions=0, token_times=list(parent.token_times),
                occupancy=Occupancy())  # what ran before the fork was the parent's
            if f.branch:  # another sample: the prompt, and its first token from this step
                child.token_times, child.num_output_tokens = [rec.t1], 1
                child.first_token_time = rec.t1
                child.num_computed_tokens = parent.num_prompt_tokens
                child.status = RequestStatus.RUNNING
                child.admitted_time = parent.admitted_time if parent.admitted_time \
                    is not None else rec.t0
            self.requests[f.request_id] = child
        for sw in rec.switches:  # requests preempted to fit a re-laid pool
            for rid in sw.preempted:
                self._preempted(rid, rec)
            self.switches = [*self.switches[1 - RECENT:], sw.at(rec.step)]
            if sw.knob == "offload_layers":
                self.offload, self.offload_gain_bytes = sw.offload, sw.gain
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

    def _kv_events(self, rec: StepRecord) -> None:
        """The step's KV events, through `KVState.apply`, and what they say of requests."""
        kv = self.kv
        for ev in rec.kv:
            if isinstance(ev, Hit):  # the lookup asked about all known tokens but the last
                r = self._request(ev.request_id, rec)
                kv.apply(ev, r.num_tokens - 1)
                r.num_cached_tokens = r.num_computed_tokens = ev.num_tokens
                continue
            kv.apply(ev)
            if isinstance(ev, Unswap):  # it will recompute
                r = self.requests.get(ev.request_id)
                if r is not None and r.status is RequestStatus.SWAPPED:
                    r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0

    def _progress(self, rec: StepRecord) -> None:
        """What the plan computed and emitted, and who was preempted."""
        t1 = rec.t1
        if rec.draft_s:
            self.spec.on_draft_step(rec.draft_s, rec.dt or 0.0)
        tokens = rec.num_decode + rec.num_prefill
        per_token = (rec.dt or 0.0) / tokens if tokens else 0.0
        for rid, start, n, sample, draft in rec.plan:
            r = self._request(rid, rec)
            if rid not in rec.errors:  # the engine charges no row that failed
                r.occupancy.charge(r.num_prompt_tokens, start, n, draft, per_token)
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

    def _endings(self, rec: StepRecord) -> None:
        """Finished requests and the step's figures."""
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
            self.last_batch = BatchView.of(rec, k.max_num_batched_tokens, k.max_num_seqs)
            self.last_ran = rec
            self.figures.on_step(step_figures(rec, self.usage,
                                              self.pool.num_cached_only / self.num_blocks,
                                              self.tree.hit_rate), rec)
        else:
            self.figures.waste.on_idle(rec)

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
                           tuple(self.tables.get(r.request_id, ())), r.occupancy.values(),
                           r.lora)

    def snapshot(self) -> EngineSnapshot:
        """The console's view of the engine after the last applied record."""
        h, tree = self.header, self.tree
        kv_format = self.knobs.get("kv_format", h.get("kv_format", "?"))
        kv = KVView(self.num_blocks, self.block_size, kv_format,
                    self.kv.bytes_per_block, self.block_states(), self.pool.num_free,
                    self.pool.num_cached_only, self.kv.num_reserved, self.usage, tree.num_nodes,
                    tree.hit_rate, tree.num_evictions, self.num_cow, tree.num_query_tokens,
                    tree.num_hit_tokens, (),
                    h.get("draft_kv_bytes_per_token", {}).get(kv_format, 0) * self.block_size,
                    h.get("draft_model", ""),
                    window_view(self.groups, self.pool.states, self.kv.page_groups))
        live = [r for r in self.requests.values() if r.arrival_time <= self.time]
        counts = self.figures.status_counts
        knobs = Knobs(**self.knobs) if self.knobs else Knobs()
        return EngineSnapshot(
            step=self.step + 1, time=self.time, model_name=h.get("model", "?"),
            executor=f"replay of {h.get('executor', '?')}",
            knobs=knobs,
            waiting=tuple(self._view(r) for r in live if r.status is not RequestStatus.RUNNING),
            running=tuple(self._view(r) for r in live if r.status is RequestStatus.RUNNING),
            batch=self.last_batch, kv=kv,
            prefix_nodes=tuple(summarize_tree(tree, values=False)),  # its cost is not the engine's
            num_finished=counts.get("finished_stopped", 0) + counts.get("finished_length", 0),
            num_rejected=counts.get("rejected", 0), num_aborted=counts.get("aborted", 0),
            num_preemptions=self.num_preemptions,
            recent=self.figures.rolling(), figures=self.figures.view(),
            energy=_energy(h.get("modelled_power"), self.figures.busy_seconds,
                           self.figures.num_good),
            switches=tuple(self.switches), transfers=self.transfers_view(),
            speculation=self.spec.view(knobs.speculative_method, knobs.num_speculative_tokens,
                                       h.get("draft_model", "")),
            roofline=self.peaks.step(self.last_ran) if self.peaks is not None else None,
        )

    def transfers_view(self) -> TransfersView:
        log = self.transfer_log
        counters = log.view_counters(self.kv.num_swap_outs, self.kv.num_swap_ins, self.tree)
        h = self.header
        link = h.get("link_bandwidth", 0.0)
        return TransfersView(
            link, h.get("link", f"{link / 1e9:,.1f} GB/s"), self.host.num_blocks,
            self.host.num_swapped, self.host.num_demoted, self.kv.bytes_per_block,
            bytes(self.host.states), tuple(self.host_tables), counters, log.last,
            tuple(log.recent), self.offload, self.offload_gain_bytes)

    def check_integrity(self) -> None:
        """The rebuilt pool, tree, tables and host tier agree (`KVState.check_integrity`)."""
        self.kv.check_integrity()


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
    summary["energy"] = _energy(h.get("modelled_power"), state.figures.busy_seconds,
                                summary["num_good"])
    return summary


def _energy(power, busy_s: float, num_good: int) -> dict:
    """A replayed summary's energy: a sim run's modelled again from its card's power (the
    header's `modelled_power`, [card, watts]); a real run's counters were read live only."""
    if power is None:
        return energy_figures(None, "not recorded: a run's energy counters are read while it "
                                    "runs", 0)
    if not (isinstance(power, list) and len(power) == 2 and isinstance(power[0], str)
            and isinstance(power[1], (int, float))):
        raise RunFormatError(f"The run header's modelled_power must be [card, watts], got "
                             f"{power!r}.")
    return modelled_energy(busy_s, power[0], float(power[1]), num_good)


def _peaks(header: dict) -> Peaks | None:
    """The recorded roofline peaks (a sim run's), or None; a malformed entry is a bad run."""
    data = header.get("peaks")
    if data is None:
        return None
    try:
        return Peaks(**{k: float(data[k]) for k in ("bandwidth", "peak_flops",
                                                    "flops_per_token", "flops_per_pair")})
    except (TypeError, KeyError, ValueError):
        raise RunFormatError(f"The run header's peaks must give bandwidth, peak_flops, "
                             f"flops_per_token and flops_per_pair as numbers, got {data!r}."
                             ) from None

"""The engine: the three-call iteration, a thread-safe inbox, clocks, failure and snapshots.

    plan   = scheduler.schedule()
    result = executor.execute(plan)
    events = scheduler.update(plan, result)

Everything from outside — new requests, aborts, knob changes, pause, resume, single steps,
starting and stopping a recording — is a typed message (`commands.py`) put in `inbox` and
applied at the start of an iteration, so engine state is touched only by the thread that
calls `step()`. Knob changes are validated when submitted (an invalid value raises and
changes nothing) and recorded in the iteration trace when applied.

Failure contract: an executor's `StepError` fails that step's requests and the engine goes
on; any other exception stops the engine (`fail`): every pending request is aborted with the
reason, listeners are told (so output streams end with an error), the traceback goes to a
log file, and new requests are refused.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

from kvdeck.runtime.core.checkpoint import Checkpoint, RequestState, checkpoint_of
from kvdeck.runtime.core.clock import PacedClock, VirtualClock, WallClock
from kvdeck.runtime.core.commands import (
    Abort,
    AddRequest,
    InboxMessage,
    Pause,
    Resume,
    SetKnobs,
    SetPriority,
    StartRecording,
    StepOnce,
    StopRecording,
    Watch,
)
from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.pool_size import PoolSize
from kvdeck.runtime.core.request import Progress, Request, RequestStatus, SamplingParams
from kvdeck.runtime.core.scheduler import Scheduler
from kvdeck.runtime.core.step_data import (
    SchedulerOutput,
    StepResult,
    StepTiming,
    causal_pairs,
)
from kvdeck.runtime.core.step_record import Finished, Forked, StepRecord
from kvdeck.runtime.core.switch import Switch
from kvdeck.runtime.core.switches import KnobSwitches
from kvdeck.runtime.errors import (
    ConfigError,
    EngineFailedError,
    QueueFullError,
    RequestError,
    StepError,
)
from kvdeck.runtime.executors.base import Executor
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.kv.transfers import TransferLog
from kvdeck.runtime.logs import write_failure
from kvdeck.runtime.models.weight_formats import format_weight_format, parse_weight_format
from kvdeck.runtime.text.checks import AnswerCheck
from kvdeck.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer, forced_runs
from kvdeck.runtime.views.figures import RunFigures, step_figures
from kvdeck.runtime.views.metrics import request_metrics
from kvdeck.runtime.views.snapshot import (
    EngineFailure,
    EngineSnapshot,
    RequestDetail,
    SnapshotBuilder,
    TrackedOutput,
)

log = logging.getLogger("kvdeck.engine")
MAX_TRACKED = 8
MAX_BRANCHES = 64
"""The most samples of one prompt (`n`, `best_of`)."""


class Engine:
    """Scheduler + KV manager + executor, stepped by one thread."""

    def __init__(self, config: EngineConfig, executor: Executor, *,
                 tokenizer: Tokenizer | None = None, pace: float | None = None,
                 completed_history: int = 10_000):
        """`pace`: for a virtual-time executor, virtual seconds per wall second (the console
        and the simulated server); None runs virtual time as fast as it goes."""
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        """Detokenizes outputs and matches stop strings (None: token ids only)."""
        kv_format = config.knobs.kv_format
        formats = executor.resolve_weight_formats(config.knobs.weight_format)
        if formats != executor.weight_formats:
            executor.set_weight_formats(formats)
        if config.knobs.offload_layers:  # before sizing the pool: offload frees memory for it
            executor.set_offload(config.knobs.offload_layers, config.knobs.offload_buffers)
        self.groups = executor.layer_groups() if config.free_window_kv else None
        """The layer groups when sliding-window KV is freed (`kv/groups.py`), else None."""
        if self.groups is not None and config.host_kv_memory_bytes:
            raise ConfigError("free_window_kv cannot have a host KV tier: window pages are "
                              "not swapped or demoted; drop --host-kv-memory-gib or "
                              "--free-window-kv.")
        self.pool = PoolSize(config, executor, self.groups)
        num_blocks = self.pool.blocks(kv_format)
        executor.bind_kv(num_blocks, config.block_size, kv_format, groups=self.groups)
        host_blocks = self.pool.host_blocks(kv_format)
        executor.bind_host_kv(host_blocks)
        text = format_weight_format(formats)
        if text != config.knobs.weight_format:  # knobs hold the resolved value (`measured`)
            config = self.config = dataclasses.replace(
                config, knobs=config.knobs.with_changes(weight_format=text))
        self.max_model_len = min(config.max_model_len or executor.max_model_len,
                                 executor.max_model_len)
        if not executor.virtual_time:
            self.clock: WallClock = WallClock()
        else:
            self.clock = PacedClock(pace) if pace else VirtualClock()
        self.step_count = 0
        self.num_changes = 0
        """Bumped by every inbox message and every step: a loop publishes a snapshot when
        it moved."""
        k = config.knobs
        self.kv = BlockManager(
            num_blocks, config.block_size, enable_caching=k.enable_prefix_caching,
            cache_capacity=k.prefix_cache_capacity, eviction_policy=k.eviction_policy,
            namespace=self.pool.namespace(kv_format),
            bytes_per_block=self.pool.block_bytes(kv_format),
            recompute_cost=lambda h, c: executor.estimate_step_seconds(
                c, causal_pairs(c, h), h + c),
            clock=lambda: self.step_count, host_blocks=host_blocks,
            link_seconds=lambda nbytes: nbytes / executor.link_bandwidth,
            groups=self.groups,
        )
        self.kv.admission.configure(k.cache_admission_k, k.cache_admission_window)
        self.transfer_log = TransferLog()
        self.scheduler = Scheduler(config, self.kv, executor.estimate_step_seconds,
                                   self.max_model_len, executor.eos_token_ids)
        self.scheduler.propose = lambda req, k: executor.propose(req, k, self.scheduler.knobs)
        self.scheduler.drafts.draft_estimate = executor.estimate_draft_seconds
        self.stop_event = threading.Event()
        """Set to cut a paced step's sleep short (shutdown)."""
        self.switcher = KnobSwitches(executor, self.kv, self.scheduler, self.clock, self.pool,
                                     self.stop_event, kv_format)
        self.check_knobs(k)
        self.inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self.wake = threading.Event()
        """Set whenever something is put in the inbox, so an idle loop wakes up."""
        self.submitted_knobs = k
        """The knobs that will apply (validated on submission; applied between steps)."""
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._future: list[tuple[float, int, Request]] = []
        self._cancelled: list[Request] = []
        self._forks: list[Forked] = []
        self._num_queued = 0
        self.figures = RunFigures()
        self.completed: deque[Request] = deque(maxlen=completed_history)
        """The most recently finished requests (bounded: a server runs for days)."""
        self.on_finish: list[Callable[[Request], None]] = []
        """Called on the engine thread with each request that reaches a final state."""
        self.after_step: list[Callable[[Engine], None]] = []
        """Called on the engine thread after every iteration that did something."""
        self.recorder: Callable[..., None] | None = None
        """Receives each step's `StepRecord` (see runtime/runs/recording.py)."""
        self._recorder_actions: list[object | None] = []
        """Recorders to attach (a Recorder) or a detach (None), in the order asked."""
        self.last_step: tuple[StepRecord, int, int] | None = None
        """The last step that ran, with its token budget and sequence limit (the
        snapshot's batch view)."""
        self.state_end: float | None = None
        """End time of the step that produced the current state; None once the engine has
        idled since (snapshots then show the clock's time). Live and replayed snapshots of
        the same step thus carry the same time."""
        self.paused = False
        self._step_credit = 0
        self.failure: EngineFailure | None = None
        self.tracked: dict[str, Request] = {}
        self.watched: Request | None = None
        self._watched_id: str | None = None
        self._snapshots = SnapshotBuilder(self)
        self._grammars = None
        """Compiles output constraints (`guided.Grammars`), made on the first one."""

    # -- thread-safe submission -------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                    *, request_id: str | None = None, arrival_time: float | None = None,
                    deadline_s: float | None = None, priority: int = 0,
                    track: bool = False, check: AnswerCheck | None = None,
                    branches: int = 1) -> Request:
        """Validate and queue a request; returns it at once (it runs on the engine thread).

        `arrival_time` in the future (engine clock) schedules the arrival, as trace replay
        does; `deadline_s` is relative to arrival; `track` puts the request's text in every
        snapshot (the console's prompt); `check` is what the answer must satisfy to count
        as correct (it needs a tokenizer: checks read text); `branches` > 1 (the API's `n`)
        samples the prompt
        that many times: the request returned is the first sample and `branches` holds the
        others, which share its prompt's KV blocks (one prefill). Seeded branches take
        seeds `seed`, `seed + 1`, ... (as vLLM's). Raises RequestError, QueueFullError or
        EngineFailedError.
        """
        if self.failure is not None:
            raise EngineFailedError(f"The engine has stopped ({self.failure.message}); it "
                                    "takes no new requests.")
        sampling = sampling or SamplingParams()
        n = len(prompt_token_ids)
        if sampling.stop and self.tokenizer is None:
            raise RequestError("Stop strings need a tokenizer, and this engine has none; "
                               "use stop token ids instead.")
        if check is not None and self.tokenizer is None:
            raise RequestError("Answer checks read the answer's text, which needs a "
                               "tokenizer, and this engine has none.")
        if n == 0:
            raise RequestError("The prompt is empty; a prompt needs at least one token.")
        if not 1 <= branches <= MAX_BRANCHES:
            raise RequestError(f"n must be from 1 to {MAX_BRANCHES}, got {branches}.")
        if branches > self.config.max_waiting:
            raise RequestError(f"n = {branches} samples cannot all queue: the waiting queue "
                               f"holds {self.config.max_waiting:,} requests (--max-waiting).")
        guide = self._start_guide(sampling) if sampling.guide is not None else None
        if n > self.max_model_len - 1:
            raise RequestError(f"The prompt has {n:,} tokens but the model's context allows "
                               f"at most {self.max_model_len - 1:,}.")
        if n + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens {sampling.max_tokens:,} with a {n:,}-token prompt exceeds the "
                f"context of {self.max_model_len:,} tokens; at most "
                f"{self.max_model_len - n:,} new tokens fit.")
        with self._lock:
            if self._num_queued + branches > self.config.max_waiting:
                raise QueueFullError(f"The waiting queue is full ({self.config.max_waiting:,} "
                                     "requests); retry later.")
            self._num_queued += branches
            rid = request_id or f"req-{next(self._ids)}"
        arrival = self.clock.arrival_time() if arrival_time is None else arrival_time

        def make(request_id: str, params: SamplingParams) -> Request:
            r = Request(request_id, list(prompt_token_ids), params, arrival_time=arrival,
                        deadline=arrival + deadline_s if deadline_s is not None else None,
                        priority=priority, check=check)
            if self.tokenizer is not None:
                r.detokenizer = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids,
                                                       params.stop)
            r.tracked = track
            return r

        req = make(rid, sampling)
        req.guide = guide
        seed = sampling.seed
        # Branches sample on their own (their seeds, or their ids), and the prompt's
        # logprobs are the first sample's to report.
        req.branches = [make(f"{rid}.{i}", dataclasses.replace(
            sampling, seed=None if seed is None else seed + i, prompt_logprobs=None))
            for i in range(1, branches)]
        req.branched = not req.branches
        self.post(AddRequest(req))
        return req

    def _start_guide(self, sampling: SamplingParams):
        """A request's grammar state (`runtime/text/guided.py`), compiled on the caller's thread;
        RequestError when the constraint does not compile or this engine cannot apply it."""
        if not self.executor.computes_logits:
            raise RequestError("Constrained output (a JSON schema, regex, choice or grammar) "
                               "needs a model executor (torch or llama_cpp); the sim executor "
                               "computes no logits to constrain.")
        if self.tokenizer is None:
            raise RequestError("Constrained output needs the model's tokenizer, and this "
                               "engine has none.")
        with self._lock:
            if self._grammars is None:
                from kvdeck.runtime.text.guided import Grammars

                ends = (*self.executor.eos_token_ids, *self.tokenizer.end_of_turn_ids)
                self._grammars = Grammars(self.tokenizer, tuple(dict.fromkeys(ends)),
                                          self.executor.vocab_size)
        return self._grammars.start(sampling.guide)

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort a request; returns at once. Its blocks come back after the in-flight step."""
        self.post(Abort(request_id, reason))

    def set_knobs(self, **changes) -> Knobs:
        """Validate knob changes now (raising ConfigError, changing nothing, if invalid) and
        apply them at the next iteration boundary. Returns the knobs that will apply."""
        with self._lock:
            new = self.submitted_knobs.with_changes(**changes)
            if "weight_format" in changes:  # stored resolved, so pending shows the result
                formats = self.executor.resolve_weight_formats(
                    new.weight_format,
                    parse_weight_format(self.submitted_knobs.weight_format))
                new = new.with_changes(weight_format=format_weight_format(formats))
            self.check_knobs(new)
            self.submitted_knobs = new
        self.post(SetKnobs(new, changes))
        return new

    @property
    def kv_format(self) -> str:
        """The format the pool holds now (the knob's value once a change has applied)."""
        return self.switcher.kv_format

    @property
    def switches(self) -> deque[Switch]:
        """The latest knob switches (`core/switches.py`)."""
        return self.switcher.recent

    def check_knobs(self, knobs: Knobs) -> None:
        """Bounds that depend on this engine's executor and pool (ConfigError if broken)."""
        if knobs.preemption != "recompute" and self.groups is not None:
            raise ConfigError(f"preemption {knobs.preemption} needs a host KV tier, which "
                              "free_window_kv rules out (window pages are not swapped); use "
                              "recompute.")
        if knobs.preemption != "recompute" and not self.kv.has_host_tier:
            raise ConfigError(f"preemption {knobs.preemption} needs a host KV tier; give it "
                              "--host-kv-memory-gib (setting host_kv_memory_bytes) of at least "
                              f"one block ({self.kv.bytes_per_block:,} bytes), or use "
                              "recompute.")
        if knobs.speculative_method == "draft" and not self.executor.draft_model_name:
            how = "--draft-cost C (a modelled draft)" if self.executor.virtual_time else \
                "--draft-model NAME|PATH (a GGUF sharing the model's tokenizer)"
            raise ConfigError(f"speculative_method draft needs a draft model; start with "
                              f"{how}, or use ngram.")
        if knobs.max_num_seqs > self.executor.max_sequences:
            raise ConfigError(f"max_num_seqs must be at most {self.executor.max_sequences} "
                              f"with {self.executor.name} (its slots, --n-parallel), got "
                              f"{knobs.max_num_seqs}.")
        if knobs.offload_layers > self.executor.num_layers:
            raise ConfigError(f"offload_layers must be from 0 to {self.executor.num_layers} "
                              f"(the model's layers), got {knobs.offload_layers}.")
        pool = self.kv.num_blocks
        if knobs.kv_format != self.kv_format:
            # The executor refuses a format it cannot store; the budget must buy a block.
            pool = self.pool.blocks(knobs.kv_format)
        if knobs.prefix_cache_capacity > pool:
            raise ConfigError(f"prefix_cache_capacity must be from 0 to {pool:,} (the pool's "
                              f"blocks), got {knobs.prefix_cache_capacity:,}.")

    def fork(self, parent: Request, child_id: str,
             sampling: SamplingParams | None = None) -> Request:
        """Branch a running request (engine thread only): the child shares every block of
        the parent and continues from the same tokens; the next record says so."""
        child = self.scheduler.fork(parent, child_id, sampling)
        with self._lock:
            self._num_queued += 1
        self._forks.append(Forked(child_id, parent.request_id, child.sampling.max_tokens))
        return child

    def post(self, message: InboxMessage) -> None:
        """Put a message in the inbox (any thread) and wake the engine."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("inbox %s", message.to_json())
        self.inbox.put(message)
        self.wake.set()

    # -- the iteration ----------------------------------------------------------------------

    def _drain_inbox(self, record: StepRecord) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.num_changes += 1
            if isinstance(msg, AddRequest):
                req = msg.request
                heapq.heappush(self._future, (req.arrival_time, next(self._ids), req))
                if req.tracked:
                    self.tracked[req.request_id] = req
                    while len(self.tracked) > MAX_TRACKED:
                        del self.tracked[next(iter(self.tracked))]
            elif isinstance(msg, Abort):
                self._abort(msg.request_id, msg.reason)
            elif isinstance(msg, SetKnobs):
                record.switches += self.switcher.apply(msg.knobs, self.step_count)
                self.scheduler.apply_knobs(msg.knobs)
                record.knobs.update(msg.changes)
            elif isinstance(msg, Pause):
                self.paused = True
                self.clock.freeze()
            elif isinstance(msg, Resume):
                if self.paused:
                    self.paused = False
                    self.clock.resume()
            elif isinstance(msg, StepOnce):
                self._step_credit += msg.count
            elif isinstance(msg, Watch):
                self.watched = self.find(msg.request_id) if msg.request_id else None
                self._watched_id = msg.request_id
            elif isinstance(msg, SetPriority):
                req = self.find(msg.request_id)
                if req is not None and not req.status.is_finished:
                    req.events.append((self.clock.now(), f"priority {req.priority} → "
                                                         f"{msg.priority}"))
                    req.priority = msg.priority
            elif isinstance(msg, StartRecording):
                self._recorder_actions.append(msg.recorder)
            elif isinstance(msg, StopRecording):
                self._recorder_actions.append(None)

    def _abort(self, rid: str, reason: str) -> None:
        req = self.scheduler.abort(rid, self.clock.now(), reason)
        if req is None:  # not yet arrived: drop it from the future arrivals
            for i, (_, _, r) in enumerate(self._future):
                if r.request_id == rid:
                    self._future.pop(i)
                    heapq.heapify(self._future)
                    for x in (r, *r.branches):  # its other samples never started either
                        x.status, x.reason = RequestStatus.ABORTED, reason
                        x.finish_time = x.arrival_time
                        self._cancelled.append(x)
                    r.branched = True
                    break

    def _release_arrivals(self, record: StepRecord) -> float:
        """Move requests whose arrival time has come into the scheduler; returns now."""
        clock = self.clock
        # Idle on virtual time: jump to the next arrival (a paced clock jumps only for a
        # single step asked for while paused).
        jumps = clock.jumps or (self.paused and self.executor.virtual_time)
        if jumps and not self.scheduler.running and not self.scheduler.waiting and self._future:
            clock.advance_to(self._future[0][0])
        now = clock.now()
        while self._future and self._future[0][0] <= now:
            _, _, req = heapq.heappop(self._future)
            # Time spent between the scheduled arrival and this step counts as resident.
            self.figures.on_arrival(now - req.arrival_time)
            req.events.append((req.arrival_time, "arrived"))
            self.scheduler.add(req)
            if self.recorder is not None:
                on_request = getattr(self.recorder, "on_request", None)
                if on_request is not None:
                    on_request(req)
            record.arrived.append(RequestState(req.request_id, req.arrival_time,
                                               req.num_prompt_tokens, req.sampling.max_tokens,
                                               req.deadline, req.priority))
        return now

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._future
                    or not self.inbox.empty())

    def next_arrival_in(self) -> float | None:
        """Wall seconds until the next scheduled arrival, or None when none is scheduled."""
        return self.clock.seconds_until(self._future[0][0]) if self._future else None

    def step(self) -> StepRecord | None:
        """Run one iteration; returns its record, or None when nothing happened."""
        record = StepRecord(self.step_count, t0=self.clock.now())
        record.forked, self._forks = self._forks, []
        self._drain_inbox(record)
        if self.paused:
            if not self._step_credit:
                return self._idle(record)
            self._step_credit -= 1
        self.clock.pin()
        record.t0 = t0 = self._release_arrivals(record)
        plan = self.scheduler.schedule(self.step_count, t0)
        if plan.is_empty:
            self.clock.float()  # nothing ran: a paced clock follows the wall until work comes
            return self._idle(record, plan)
        self.num_changes += 1
        self.kv.begin_step()
        try:
            result = self.executor.execute(plan)
        except StepError as e:  # failure contract: fail the step's requests, keep serving
            log.warning("step %d failed: %s", self.step_count, e)
            result = StepResult({}, StepTiming(0.0, True, 0, 0, 0),
                                {c.request_id: str(e) for c in plan.chunks})
            if plan.transfers:  # copies out may not have happened: trust no host copy
                self.scheduler.unswap_all(self.clock.now(), "the step that copied it failed")
                self.kv.tree.drop_host()
        finally:
            self.kv.end_step()
        resident = self.scheduler.num_waiting + self.scheduler.num_running
        dt = result.timing.seconds
        self.clock.advance(dt)
        self.clock.wait_until_due(self.stop_event)  # a paced sim step takes its time
        t1 = self.state_end = self.clock.now()
        self.scheduler.update(plan, result, t1)
        if result.lost_blocks:
            self.kv.forget_blocks(result.lost_blocks)
        for child, parent in self.scheduler.take_branched():
            record.forked.append(Forked(child.request_id, parent.request_id,
                                        child.sampling.max_tokens, True))
        record.ran(plan, result, t1)
        self.last_step = (record, plan.token_budget, plan.max_num_seqs)
        if result.draft_seconds:
            self.scheduler.spec.on_draft_step(result.draft_seconds, dt)
        if result.transfers:
            self.transfer_log.on_step(plan.step, result.transfers)
        self._collect(record)
        self.step_count += 1
        record.resident = resident
        self._finish_step(record)
        return record

    def _idle(self, record: StepRecord, plan: SchedulerOutput | None = None) -> \
            StepRecord | None:
        """End a step that ran nothing: still a record if knobs, arrivals, rejections or
        aborts happened."""
        self.state_end = None
        self._collect(record)
        if plan is not None:
            record.rejected = list(plan.rejected)
        record.kv = self.kv.take_events()
        if record.is_empty:
            self._switch_recorder()
            return None
        self._finish_step(record)
        return record

    def _finish_step(self, record: StepRecord) -> None:
        """Complete the record, update the figures, write the record, tell `after_step`
        listeners (output streams), then attach or detach a recorder if asked."""
        record.kv += self.kv.take_events()
        sched = self.scheduler
        record.queue = (sched.num_waiting, sched.num_running)
        if record.dt is not None:
            kv = self.kv
            self.figures.on_step(step_figures(record, kv.usage,
                                              kv.tree.num_evictable / kv.num_blocks,
                                              kv.tree.hit_rate))
        if self.recorder is not None:
            self.recorder(record)
        for callback in self.after_step:
            callback(self)
        self._switch_recorder()

    def _switch_recorder(self) -> None:
        """Between steps: detach and close the current recorder, attach new ones (each
        starting with a checkpoint of the state now), in the order they were asked for."""
        actions, self._recorder_actions = self._recorder_actions, []
        for rec in actions:
            old, self.recorder = self.recorder, None
            if old is not None and hasattr(old, "close"):
                old.close()
            if rec is not None:
                rec.begin(self.checkpoint())
                self.recorder = rec

    def _collect(self, record: StepRecord) -> None:
        """Hand finished requests to their listeners. Requests cancelled before they arrived
        never entered the engine: their clients are told, the figures and trace are not."""
        done = self.scheduler.take_finished()
        cancelled, self._cancelled = self._cancelled + self.scheduler.take_unstarted(), []
        if not done and not cancelled:
            return
        with self._lock:
            self._num_queued -= len(done) + len(cancelled)
        for req in done:
            self.completed.append(req)
            if req.check is not None and req.status in (RequestStatus.FINISHED_STOPPED,
                                                        RequestStatus.FINISHED_LENGTH):
                req.correct = req.check.passes(req.output_text or "")
            self.figures.on_finish(request_metrics(req))
            self.executor.forget(req.request_id)
            record.finished.append(Finished(req.request_id, req.status.value, req.reason,
                                            req.finish_time, req.correct))
        for req in done + cancelled:
            for callback in self.on_finish:
                callback(req)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until nothing is queued, running or due to arrive; returns steps taken."""
        n = 0
        while self.has_work and (max_steps is None or n < max_steps):
            if self.step() is None and not self._future and self.inbox.empty():
                break
            n += 1
        return n

    # -- failure ----------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> EngineFailure:
        """Stop for good after an unexpected exception: write the traceback to a log file,
        abort every pending request with the reason (their streams end with an error) and
        refuse new ones. Returns the failure the snapshot reports."""
        message = f"{type(exc).__name__}: {exc}".strip()
        path = write_failure(exc, f"engine failed at step {self.step_count}: {message}")
        self.failure = EngineFailure(message, str(path) if path else None)
        reason = f"engine failed: {message}"
        now = self.clock.now()
        admitted = list(self.scheduler.running) + list(self.scheduler.waiting)
        future = [r for _, _, r in self._future]
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, AddRequest):
                future.append(msg.request)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self._future.clear()
        self.kv.in_flight = False
        # Samples of a prompt whose branches never started end with it.
        future += [b for r in admitted + future if not r.branched for b in r.branches]
        for req in admitted + future:
            req.status, req.reason, req.finish_time = RequestStatus.ABORTED, reason, now
        for req in admitted:
            try:
                self.kv.release(req)
            except Exception:  # noqa: BLE001 - state may be inconsistent after the failure
                log.exception("could not release %s after the failure", req.request_id)
        self.scheduler.finished.extend(admitted)
        self._cancelled.extend(future)
        record = StepRecord(self.step_count, t0=now)
        self._collect(record)
        for callback in self.after_step:
            callback(self)
        return self.failure

    # -- views ------------------------------------------------------------------------------

    def find(self, request_id: str) -> Request | None:
        """The request with this id, wherever it is: queued, running, due or finished."""
        sched = self.scheduler
        for req in itertools.chain(sched.running, sched.waiting,
                                   (r for _, _, r in self._future), reversed(self.completed)):
            if req.request_id == request_id:
                return req
        return None

    def watched_detail(self) -> RequestDetail | None:
        req = self.watched
        if req is None and self._watched_id is not None:  # it arrived since it was asked for
            req = self.watched = self.find(self._watched_id)
        if req is None:
            return None
        table = self.kv.tables.get(req.request_id)
        return RequestDetail(req.request_id, req.status.value, req.reason,
                             req.num_prompt_tokens, req.num_output_tokens,
                             req.num_cached_tokens, req.priority, tuple(req.events),
                             tuple(table) if table else ())

    def tracked_outputs(self) -> list[TrackedOutput]:
        return [self._tracked_output(req) for req in self.tracked.values()]

    def _tracked_output(self, req: Request) -> TrackedOutput:
        """A followed request's text (forced runs marked when constrained) and its
        branches'."""
        text = req.output_text
        if text is None:
            text = " ".join(map(str, req.output_token_ids))
        guide = req.guide
        segments = forced_runs(self.tokenizer, req.prompt_token_ids, req.output_token_ids,
                               guide.forced) if guide is not None and self.tokenizer else ()
        branches = tuple(self._tracked_output(b) for b in req.branches
                         if b.status is not RequestStatus.WAITING)
        return TrackedOutput(req.request_id, req.status.value, req.num_prompt_tokens,
                             req.num_output_tokens, req.sampling.max_tokens, text, req.reason,
                             req.sampling.guide.label if req.sampling.guide else None,
                             segments, branches)

    def snapshot(self, max_prefix_nodes: int = 256) -> EngineSnapshot:
        """Build an immutable view; call from the engine thread (or when it is stopped)."""
        return self._snapshots.build(max_prefix_nodes)

    def checkpoint(self) -> Checkpoint:
        """The state a recording starting now begins from (engine thread, between steps)."""
        sched, kv = self.scheduler, self.kv
        requests = []
        for req in list(sched.running) + list(sched.waiting):
            progress = {f.name: getattr(req, f.name) for f in dataclasses.fields(Progress)}
            progress["token_times"] = list(req.token_times)
            requests.append(RequestState(
                req.request_id, req.arrival_time, req.num_prompt_tokens,
                req.sampling.max_tokens, req.deadline, req.priority,
                num_output_tokens=req.num_output_tokens, **progress))
        return checkpoint_of(
            kv.state, step=self.step_count, time=self.clock.now(),
            knobs=dataclasses.asdict(sched.knobs), requests=requests,
            counters={"preemptions": sched.num_preemptions, "cow": kv.num_cow_copies,
                      "swapped": sched.num_swapped},
            figures=self.figures.to_json(), switches=list(self.switches),
            transfer_log=self.transfer_log, spec=sched.spec.to_json())

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for req in self.scheduler.running:
            assert req.request_id in self.kv.tables
            if req.sampling.prompt_logprobs is not None:
                # Every computed prompt position scored its next token, once.
                scored = len(req.prompt_logprobs_out)
                want = min(req.num_computed_tokens, req.num_prompt_tokens - 1)
                assert want <= scored <= req.num_prompt_tokens - 1, \
                    f"{req.request_id} scored {scored} prompt tokens, computed {want}"
        for req in self.scheduler.waiting:
            assert req.request_id not in self.kv.tables
            assert (req.status is RequestStatus.SWAPPED) == \
                (req.request_id in self.kv.host_tables), f"{req.request_id} swap state"

    def close(self) -> None:
        self.stop_event.set()
        self.executor.close()
